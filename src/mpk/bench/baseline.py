"""The torch.compile baseline: the strongest usual single-GPU alternative to the megakernel.

This is the gpt-fast recipe (see shared/reference/h200-baselines.md): a plain PyTorch decoder
with fused QKV and gate/up weights, RMSNorm, RoPE from a table, a static KV cache written in
place at the current position, scaled_dot_product_attention over the whole cache with a mask,
argmax on the device, and the one-token step wrapped in
torch.compile(mode="reduce-overhead", fullgraph=True) so each step replays one CUDA graph.

It deliberately imports nothing from mpk.graph / mpk.compiler / mpk.tasks: the comparison must
not share code (or bugs) with the system it is compared against.

Every shape is static and the position is a device tensor, never a Python int: a Python int
would be baked into the graph (a recompile per position), and slicing the cache to the current
length would change shapes. Hence the mask over all max_seq slots.

Qwen3-MoE's sparse layers (baseline_moe.py) keep their experts stacked and index the stack with
the step's top-k ids, as gpt-fast's MoE models do; a MoE model's dense layers (mlp_only_layers,
decoder_sparse_step) keep the dense MLP below.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mpk.bench.baseline_moe import moe_mlp, stack_experts
from mpk.errors import UnsupportedError
from mpk.models.config import ModelConfig
from mpk.models.rope import rope_table
from mpk.models.weights import check_weights

#: One decode step: (tokens [B] long, pos [] or [B] long) -> next tokens [B] long.
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face numerics: normalise in f32, cast back to x's dtype, then scale.

    Inductor fuses the casts, the reduction and the scale into one kernel, so writing it the
    HF way costs the baseline nothing."""
    xf = x.float()
    if hasattr(F, "rms_norm"):
        y = F.rms_norm(xf, (x.shape[-1],), eps=eps)
    else:  # torch < 2.4
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [B, heads, D] with cos/sin [B, 1, D/2] (f32), result in x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class _Layer(nn.Module):
    """One decoder layer's weights and KV cache, all as buffers (no autograd, static addresses
    for CUDA graphs)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], i: int,
                 max_seq: int, batch: int, dtype: torch.dtype) -> None:
        super().__init__()
        p = f"model.layers.{i}."

        def w(name: str) -> torch.Tensor:
            return weights[p + name].to(dtype)  # no copy when the dtype already matches

        # Fused once here so each step runs one GEMV for Q/K/V and one for gate/up.
        self.register_buffer("wqkv", torch.cat([w("self_attn.q_proj.weight"),
                                                w("self_attn.k_proj.weight"),
                                                w("self_attn.v_proj.weight")]))
        self.register_buffer("wo", w("self_attn.o_proj.weight"))
        # A plain bool: dynamo specialises on it, so each layer traces only its own MLP.
        self.moe = cfg.is_moe_layer(i)
        if self.moe:
            router, gate_up, down = stack_experts(cfg, weights, i, dtype)
            self.register_buffer("router", router)          # [E, H]
            self.register_buffer("experts_gate_up", gate_up)  # [E, 2, I, H]
            self.register_buffer("experts_down", down)        # [E, H, I]
        else:
            self.register_buffer("wgu", torch.cat([w("mlp.gate_proj.weight"),
                                                   w("mlp.up_proj.weight")]))
            self.register_buffer("wdown", w("mlp.down_proj.weight"))
        self.register_buffer("input_norm", w("input_layernorm.weight"))
        self.register_buffer("post_norm", w("post_attention_layernorm.weight"))
        if cfg.qk_norm:
            self.register_buffer("q_norm", w("self_attn.q_norm.weight"))
            self.register_buffer("k_norm", w("self_attn.k_norm.weight"))
        shape = (batch, cfg.num_kv_heads, max_seq, cfg.head_dim)
        device = self.wqkv.device
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device))


class StaticDecoder(nn.Module):
    """A decoder LLM (Qwen3, Llama 3 or Qwen3-MoE) with a static KV cache; `forward` is one
    decode step.

    `dtype` is the storage and matmul dtype (bf16 for benchmarks; float32 for exact-ish tests).
    Positions must stay below max_seq (not checked: checking would need a host sync)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_seq: int,
                 batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        check_weights(cfg, weights, "the weights given to StaticDecoder")
        if max_seq <= 0 or batch <= 0:
            raise UnsupportedError(f"StaticDecoder needs max_seq > 0 and batch > 0, "
                                   f"got max_seq={max_seq}, batch={batch}")
        if max_seq > cfg.max_position:
            raise UnsupportedError(f"max_seq {max_seq} exceeds {cfg.name or cfg.arch}'s "
                                   f"max_position {cfg.max_position}")
        self.cfg, self.max_seq, self.batch, self.dtype = cfg, max_seq, batch, dtype
        embed = weights["model.embed_tokens.weight"].to(dtype)
        device = embed.device
        self.register_buffer("embed", embed)
        if not cfg.tie_embeddings:
            self.register_buffer("lm_head", weights["lm_head.weight"].to(dtype))
        self.register_buffer("norm", weights["model.norm.weight"].to(dtype))
        self.layers = nn.ModuleList(_Layer(cfg, weights, i, max_seq, batch, dtype)
                                    for i in range(cfg.num_layers))
        table = rope_table(cfg, max_seq).to(device)
        half = cfg.head_dim // 2
        self.register_buffer("cos", table[:, :half].contiguous())
        self.register_buffer("sin", table[:, half:].contiguous())
        self.register_buffer("slots", torch.arange(max_seq, device=device))
        self.register_buffer("rows", torch.arange(batch, device=device))

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def qkv(self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, heads, D], k and v [N, kv_heads, D] of x [N, hidden] (the input-normed rows),
        q and k normed (Qwen3) and rotated with cos / sin [N, 1, D/2]."""
        cfg = self.cfg
        n, d, h, kvh = x.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q, k, v = F.linear(x, layer.wqkv).split([h * d, kvh * d, kvh * d], dim=-1)
        q, k, v = q.view(n, h, d), k.view(n, kvh, d), v.view(n, kvh, d)
        if cfg.qk_norm:
            q = _rms_norm(q, layer.q_norm, cfg.rms_eps)
            k = _rms_norm(k, layer.k_norm, cfg.rms_eps)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def _attention(self, layer: _Layer, x: torch.Tensor, pos: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, d, h, kvh = x.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        q, k, v = self.qkv(layer, x, cos, sin)
        if pos.dim() == 0:  # one shared position (the benchmark case): gpt-fast's index_copy_
            layer.k_cache.index_copy_(2, pos.view(1), k.unsqueeze(2))
            layer.v_cache.index_copy_(2, pos.view(1), v.unsqueeze(2))
        else:  # one position per row: cache[r, :, pos[r]] = k[r]
            layer.k_cache[self.rows, :, pos] = k
            layer.v_cache[self.rows, :, pos] = v
        # GQA without copying the cache: the G query heads sharing a KV head become G "query
        # rows" of that head (all at the same position, so one mask row serves them all).
        # repeat_interleave of the cache would move group x the cache's bytes every step.
        out = F.scaled_dot_product_attention(q.view(b, kvh, cfg.group, d), layer.k_cache,
                                             layer.v_cache, attn_mask=mask)
        return F.linear(out.reshape(b, h * d), layer.wo)

    def hidden(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden state [B, hidden] after running tokens [B] at pos."""
        cfg = self.cfg
        b = tokens.shape[0]
        if b != self.batch:
            raise UnsupportedError(f"StaticDecoder was built for batch {self.batch}, got {b}")
        if pos.dim() > 1 or (pos.dim() == 1 and pos.shape[0] != b):
            raise UnsupportedError(f"pos must be [] or [{b}], got {list(pos.shape)}")
        pos_b = pos.expand(b) if pos.dim() == 0 else pos
        cos, sin = self.cos[pos_b].unsqueeze(1), self.sin[pos_b].unsqueeze(1)   # [B, 1, D/2]
        mask = (self.slots[None, :] <= pos_b[:, None])[:, None, None, :]        # [B, 1, 1, L]
        x = F.embedding(tokens, self.embed)
        for layer in self.layers:
            x = x + self._attention(layer, _rms_norm(x, layer.input_norm, cfg.rms_eps), pos,
                                    cos, sin, mask)
            x = x + self._mlp(layer, _rms_norm(x, layer.post_norm, cfg.rms_eps))
        return _rms_norm(x, self.norm, cfg.rms_eps)

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        if layer.moe:
            return moe_mlp(x, layer.router, layer.experts_gate_up, layer.experts_down,
                           self.cfg.num_experts_per_tok, self.cfg.norm_topk_prob)
        gate, up = F.linear(x, layer.wgu).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.wdown)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        # Tied models read the embedding table whole as the lm_head.
        return F.linear(h, self.embed if self.cfg.tie_embeddings else self.lm_head)

    def logits(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits float32 [B, V] of one step (writes the KV cache like forward)."""
        return self._head(self.hidden(tokens, pos)).float()

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One greedy decode step: next tokens [B] long, argmax taken on the device."""
        return torch.argmax(self._head(self.hidden(tokens, pos)), dim=-1)


def compile_step(model: StaticDecoder) -> StepFn:
    """The step as one CUDA graph per call: torch.compile(reduce-overhead, fullgraph).

    cudagraph_mark_step_begin tells the CUDA-graph tree that the previous step's outputs are
    dead, so each call replays the same graph instead of recording new ones. The caller must
    copy an output it wants to keep before the next call (DecodeLoop does)."""
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)

    def step(tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(tokens, pos)

    return step


class DecodeLoop:
    """Greedy decoding with a step function over persistent device buffers.

    The prompt [B, P] is fed one token per step (prefill by decode steps, as the benchmark
    does); afterwards `run(n)` restarts at position P with the first generated token each
    time, so it can be timed repeatedly without running past max_seq."""

    def __init__(self, step: StepFn, prompt: torch.Tensor, max_seq: int) -> None:
        if prompt.dim() != 2 or prompt.shape[1] == 0:
            raise UnsupportedError(f"prompt must be [B, P] with P >= 1, "
                                   f"got {list(prompt.shape)}")
        self.step, self.prompt, self.max_seq = step, prompt, max_seq
        self.tokens = torch.empty(prompt.shape[0], dtype=torch.long, device=prompt.device)
        self.pos = torch.zeros((), dtype=torch.long, device=prompt.device)
        self.first = torch.empty_like(self.tokens)

    @torch.no_grad()
    def prefill(self) -> None:
        """Run the prompt through the step; remembers the first generated token."""
        for p in range(self.prompt.shape[1]):
            self.tokens.copy_(self.prompt[:, p])
            self.pos.fill_(p)
            self.first.copy_(self.step(self.tokens, self.pos))

    def reset(self) -> None:
        """Back to just after the prompt (the cache beyond it is simply overwritten)."""
        self.tokens.copy_(self.first)
        self.pos.fill_(self.prompt.shape[1])

    @torch.no_grad()
    def run(self, n: int) -> None:
        """reset, then n decode steps, all queued on the device without a host sync."""
        self._check(n)
        self.reset()
        for _ in range(n):
            self.tokens.copy_(self.step(self.tokens, self.pos))
            self.pos.add_(1)

    @torch.no_grad()
    def generate(self, n: int) -> torch.Tensor:
        """The first n generated tokens [B, n] (the one prefill produced, then n - 1 steps)."""
        self._check(n)
        self.reset()
        out = torch.empty(self.tokens.shape[0], n, dtype=torch.long, device=self.tokens.device)
        out[:, 0] = self.tokens
        for i in range(1, n):
            self.tokens.copy_(self.step(self.tokens, self.pos))
            self.pos.add_(1)
            out[:, i] = self.tokens
        return out

    def _check(self, n: int) -> None:
        if self.prompt.shape[1] + n > self.max_seq:
            raise UnsupportedError(f"prompt {self.prompt.shape[1]} + {n} steps exceeds "
                                   f"max_seq {self.max_seq}")
