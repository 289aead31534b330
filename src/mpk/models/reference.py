"""A plain PyTorch reference model of each supported architecture (Qwen3, Llama 3, Qwen3-MoE).

This is the first correctness gate: it is checked against Hugging Face transformers and then
serves as the oracle for the interpreter and the GPU. It is written from the architecture
definition only and deliberately imports nothing from mpk.graph, mpk.compiler or mpk.tasks, so a
bug there cannot hide in both sides of a comparison.

Numerics: weights stay bf16, math runs in fp32. With activation_dtype=bfloat16 values are
rounded to bf16 wherever a bf16 Hugging Face model stores a tensor (after each linear, RMSNorm,
residual add, SiLU and SiLU*up, q/k norm, RoPE, the attention output); attention scores and
softmax stay fp32, RoPE uses the f32 table of rope.py (HF rounds cos/sin to bf16) and the logits
stay fp32 unless bf16_logits=True (HF rounds them), as the megakernel does: bf16 logits would
create argmax ties the f32 logits of the megakernel do not have. With activation_dtype=float32
nothing is rounded. hf_exact=True (bf16 only) adds the remaining roundings of transformers' eager
bf16 path (bf16 cos/sin, each RoPE product, scores, scaled scores, probabilities, bf16 logits)
and runs every matmul through torch's bf16 kernels as HF does, so that not even summation order
differs: the tests use it to show every other rounding point matches Hugging Face bit for bit.
A linear that reads an RMSNorm's output (q/k/v, the dense gate/up, the router gate, the LM head)
is computed as the megakernel fuses it (fused_norms, unless hf_exact or fp32): the norm weight
folded into the linear's weight, bf16(W * g), the raw rows multiplied by it and each row's sums
by its inverse rms, so that rounding stands where HF rounds the normalised rows (the same math,
as accurate). fused_norms=False keeps HF's order there, as a plan with unfused norms computes.

Mixture-of-experts layers (Qwen3-MoE) follow transformers' Qwen3MoeSparseMoeBlock with its default
experts implementation (grouped_mm): router logits = the (bf16-rounded) gate linear of the normed
hidden state; softmax over ALL experts in fp32; the top num_experts_per_tok probabilities (ties to
the lower expert id; torch.topk, which HF calls, leaves tie order unspecified, so hf_exact uses
torch.topk itself); divided by their sum when norm_topk_prob; rounded to bf16. Each chosen
expert's SwiGLU output (rounded like the dense MLP) is multiplied by its weight (rounded), the
products are summed over the chosen experts in fp32 and rounded once (HF's
`weighted.view(tokens, top_k, hidden).sum(dim=1)`), then added to the residual.
"""

from __future__ import annotations

import torch

from mpk.errors import UnsupportedError
from mpk.models.config import ModelConfig
from mpk.models.rope import rope_table
from mpk.models.weights import check_weights


class ReferenceModel:
    """Decoder LLM with an internal KV cache; `forward` runs a chunk of positions."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], max_seq: int,
                 activation_dtype: torch.dtype = torch.bfloat16,
                 bf16_logits: bool = False, hf_exact: bool = False,
                 fused_norms: bool = True) -> None:
        if activation_dtype not in (torch.bfloat16, torch.float32):
            raise UnsupportedError(f"activation_dtype must be bfloat16 or float32, "
                                   f"got {activation_dtype}")
        check_weights(cfg, weights, "the weights given to ReferenceModel")
        self.cfg = cfg
        self.max_seq = max_seq
        self.activation_dtype = activation_dtype
        self._round_bf16 = activation_dtype == torch.bfloat16
        self.fused_norms = fused_norms
        if hf_exact and not self._round_bf16:
            raise UnsupportedError("hf_exact needs activation_dtype=torch.bfloat16")
        self.hf_exact = hf_exact
        self.bf16_logits = bf16_logits or hf_exact
        self.w = {k: v.to(torch.bfloat16) for k, v in weights.items()}
        self.device = self.w["model.embed_tokens.weight"].device
        table = rope_table(cfg, max_seq).to(self.device)
        half = cfg.head_dim // 2
        # Full-width cos/sin ([max_seq, D]) for rotate-half: cat(cos, cos), cat(sin, sin).
        self._cos = torch.cat([table[:, :half], table[:, :half]], dim=1)
        self._sin = torch.cat([table[:, half:], table[:, half:]], dim=1)
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._batch = 0
        self._length = 0

    def reset(self) -> None:
        """Forget the KV cache (the next forward must start at position 0)."""
        self._k, self._v, self._batch, self._length = [], [], 0, 0

    # -- building blocks ---------------------------------------------------------------------

    def _round(self, x: torch.Tensor) -> torch.Tensor:
        """The value a bf16 store would hold (identity in fp32 mode)."""
        return x.to(torch.bfloat16).float() if self._round_bf16 else x

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.hf_exact:
            # HF's own bf16 kernel: see _matmul.
            return torch.nn.functional.linear(x.to(torch.bfloat16), self.w[name]).float()
        return self._round(x @ self.w[name].float().t())

    def _matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b in fp32; with hf_exact, torch's bf16 kernel as HF's eager path calls it.

        Both accumulate in fp32 and round once, but in different orders, and which order a bf16
        GEMM uses depends on the CPU's kernel (AVX2 vs AVX-512/AMX), not on transformers. A dot
        product within ~1e-6 of a bf16 rounding midpoint then rounds the other way (seen: one
        v_proj element of tiny-qwen3), and deep bf16 layers spread that 1-ulp flip to ~4e-3 of
        the logits. Calling the same kernel as HF removes summation order from the comparison."""
        if self.hf_exact:
            return (a.to(torch.bfloat16) @ b.to(torch.bfloat16)).float()
        return a @ b

    def _rmsnorm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        # HF: normalise in fp32, cast to the activation dtype, multiply by the weight.
        return self._round(self.w[name].float() * self._round(x * self._inv_rms(x)))

    def _fold(self) -> bool:
        return self.fused_norms and self._round_bf16 and not self.hf_exact

    def _inv_rms(self, x: torch.Tensor) -> torch.Tensor:
        return torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.cfg.rms_eps)

    def _norm_product(self, x: torch.Tensor, norm: str, name: str) -> torch.Tensor:
        """rmsnorm(x, norm) @ W^T in fp32, unrounded, with the norm weight folded into W (see
        the module docstring)."""
        folded = self._round(self.w[name].float() * self.w[norm].float())
        return (x @ folded.t()) * self._inv_rms(x)

    def _norm_linear(self, x: torch.Tensor, norm: str, name: str) -> torch.Tensor:
        """_linear(_rmsnorm(x, norm), name), as the megakernel fuses it."""
        if not self._fold():
            return self._linear(self._rmsnorm(x, norm), name)
        return self._round(self._norm_product(x, norm, name))

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE on x [B, heads, T, D] at absolute positions pos [T]."""
        cos, sin = self._cos[pos], self._sin[pos]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        if self.hf_exact:
            cos, sin = self._round(cos), self._round(sin)
            return self._round(self._round(x * cos) + self._round(rotated * sin))
        return self._round(x * cos + rotated * sin)

    def _attention(self, h: torch.Tensor, layer: int, start: int) -> torch.Tensor:
        """The attention block of the residual stream h (its input norm included)."""
        cfg, p = self.cfg, f"model.layers.{layer}.self_attn."
        norm = f"model.layers.{layer}.input_layernorm.weight"
        b, t, _ = h.shape
        d = cfg.head_dim
        q = self._norm_linear(h, norm, p + "q_proj.weight").view(b, t, cfg.num_heads, d)
        k = self._norm_linear(h, norm, p + "k_proj.weight").view(b, t, cfg.num_kv_heads, d)
        v = self._norm_linear(h, norm, p + "v_proj.weight").view(b, t, cfg.num_kv_heads, d)
        if cfg.qk_norm:
            q = self._rmsnorm(q, p + "q_norm.weight")
            k = self._rmsnorm(k, p + "k_norm.weight")
        pos = torch.arange(start, start + t, device=h.device)
        q = self._rope(q.transpose(1, 2), pos)                 # [B, H, T, D]
        k = self._rope(k.transpose(1, 2), pos)                 # [B, KVH, T, D]
        self._k[layer][:, :, start:start + t] = k
        self._v[layer][:, :, start:start + t] = v.transpose(1, 2)
        end = start + t
        keys = self._k[layer][:, :, :end].repeat_interleave(cfg.group, dim=1)   # [B, H, L, D]
        values = self._v[layer][:, :, :end].repeat_interleave(cfg.group, dim=1)
        exact = self._round if self.hf_exact else (lambda x: x)
        scores = exact(self._matmul(q, keys.transpose(2, 3)) * (d ** -0.5))  # [B, H, T, L]
        causal = torch.arange(end, device=h.device)[None, :] > pos[:, None]     # [T, L]
        scores = scores.masked_fill(causal, float("-inf"))
        out = self._round(self._matmul(exact(torch.softmax(scores, dim=-1)), values))  # [B,H,T,D]
        out = out.transpose(1, 2).reshape(b, t, cfg.num_heads * d)
        return self._linear(out, p + "o_proj.weight")

    def _mlp(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """The MLP block of the residual stream h (its post-attention norm included)."""
        norm = f"model.layers.{layer}.post_attention_layernorm.weight"
        if self.cfg.is_moe_layer(layer):
            return self._moe(h, layer, norm)
        p = f"model.layers.{layer}.mlp."
        gate = self._norm_linear(h, norm, p + "gate_proj.weight")
        up = self._norm_linear(h, norm, p + "up_proj.weight")
        return self._swiglu_down(gate, up, p)

    def _swiglu(self, h: torch.Tensor, p: str) -> torch.Tensor:
        gate = self._linear(h, p + "gate_proj.weight")
        up = self._linear(h, p + "up_proj.weight")
        return self._swiglu_down(gate, up, p)

    def _swiglu_down(self, gate: torch.Tensor, up: torch.Tensor, p: str) -> torch.Tensor:
        act = self._round(self._round(torch.nn.functional.silu(gate)) * up)
        return self._linear(act, p + "down_proj.weight")

    def route(self, h: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [N, k] int64, weights [N, k] fp32 holding bf16 values in bf16 mode) of the
        normed rows h [N, H] in MoE layer `layer`, best first (see the module docstring)."""
        return self._select(self._linear(h, f"model.layers.{layer}.mlp.gate.weight"))

    def _select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """route's ids and weights from the router logits."""
        cfg = self.cfg
        probs = torch.softmax(logits.float(), dim=-1)
        if self.hf_exact:
            top, ids = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
        else:  # a stable descending sort keeps equal probabilities in expert order
            top, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
            top, ids = top[:, :cfg.num_experts_per_tok], ids[:, :cfg.num_experts_per_tok]
        if cfg.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return ids, self._round(top)

    def _moe(self, h: torch.Tensor, layer: int, norm: str) -> torch.Tensor:
        """The MoE block of the residual stream h: the router's gate reads the norm fused (as
        the megakernel does: _norm_linear), the experts the normed rows."""
        shape = h.shape
        rows = h.reshape(-1, shape[-1])
        ids, weights = self._select(self._norm_linear(rows, norm,
                                                      f"model.layers.{layer}.mlp.gate.weight"))
        normed = self._rmsnorm(rows, norm)
        weighted = torch.zeros(*ids.shape, shape[-1], device=h.device)  # [N, k, H]
        for e in ids.unique().tolist():
            n, slot = torch.nonzero(ids == e, as_tuple=True)
            out = self._swiglu(normed[n], f"model.layers.{layer}.mlp.experts.{e}.")
            weighted[n, slot] = self._round(out * weights[n, slot, None])
        if self.hf_exact:  # HF sums the bf16 products with torch's bf16 reduction
            return weighted.to(torch.bfloat16).sum(dim=1).float().reshape(shape)
        return self._round(weighted.sum(dim=1)).reshape(shape)

    # -- public API --------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Logits float32 [B, T, V] for tokens [B, T] at positions start_pos .. start_pos+T-1.

        Positions before start_pos must already be in the cache (start_pos == number of
        positions processed since the last reset); start_pos == 0 starts a fresh sequence."""
        cfg = self.cfg
        if tokens.dim() != 2 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must be [B, T] with T >= 1, got {list(tokens.shape)}")
        b, t = tokens.shape
        if start_pos + t > self.max_seq:
            raise ValueError(f"positions {start_pos}..{start_pos + t - 1} exceed "
                             f"max_seq {self.max_seq}")
        if start_pos == 0:
            self._allocate(b)
        elif start_pos != self._length or b != self._batch:
            raise ValueError(f"forward at start_pos {start_pos} with batch {b}, but the cache "
                             f"holds {self._length} positions of batch {self._batch}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size}), got "
                             f"[{int(tokens.min())}, {int(tokens.max())}]")
        h = self.w["model.embed_tokens.weight"][tokens.to(self.device)].float()
        for i in range(cfg.num_layers):
            h = self._round(h + self._attention(h, i, start_pos))
            h = self._round(h + self._mlp(h, i))
        head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
        self._length = start_pos + t
        if self.hf_exact:
            return self._linear(self._rmsnorm(h, "model.norm.weight"), head)
        if self._fold():
            logits = self._norm_product(h, "model.norm.weight", head)
        else:
            logits = self._rmsnorm(h, "model.norm.weight") @ self.w[head].float().t()
        return logits.to(torch.bfloat16).float() if self.bf16_logits else logits

    __call__ = forward

    @torch.no_grad()
    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy (argmax, ties to the lowest id) continuation of each prompt: returns the
        max_new_tokens NEW tokens per prompt (no stop on eos). Prompts run one at a time, so
        different lengths need no padding; the cache is reset before each."""
        results: list[list[int]] = []
        for prompt in prompts:
            if not prompt:
                raise ValueError("generate_greedy needs non-empty prompts")
            if len(prompt) + max_new_tokens - 1 > self.max_seq:
                raise ValueError(f"prompt of {len(prompt)} + {max_new_tokens} new tokens "
                                 f"exceeds max_seq {self.max_seq}")
            self.reset()
            new: list[int] = []
            logits = self.forward(torch.tensor([prompt], device=self.device), 0)
            pos = len(prompt)
            for step in range(max_new_tokens):
                token = int(torch.argmax(logits[0, -1]))
                new.append(token)
                if step + 1 < max_new_tokens:
                    logits = self.forward(torch.tensor([[token]], device=self.device), pos)
                    pos += 1
            results.append(new)
        return results

    def _allocate(self, batch: int) -> None:
        cfg = self.cfg
        shape = (batch, cfg.num_kv_heads, self.max_seq, cfg.head_dim)
        self._k = [torch.zeros(shape, device=self.device) for _ in range(cfg.num_layers)]
        self._v = [torch.zeros(shape, device=self.device) for _ in range(cfg.num_layers)]
        self._batch, self._length = batch, 0
