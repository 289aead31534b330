"""Qwen3-MoE layers for the torch.compile baseline (baseline.py), the gpt-fast way.

gpt-fast's MoE models keep each layer's experts stacked ([E, ...] per projection) and index the
stack with the step's top-k expert ids: a gather, a batched product per (row, slot), the
routing weights, a sum over the slots. Every shape is static (B rows x k slots, whatever the
router picks), nothing is data-dependent on the host (no nonzero / unique / bincount, no
per-expert loop), so the step stays one fullgraph torch.compile graph and one CUDA graph.

The batched products are written as a broadcast multiply and an fp32 sum over the reduction
axis rather than as einsum/bmm: inductor then fuses the gather into the reduction kernel and
reads each chosen expert's weights straight from the stack. A bmm would first materialise the
gathered copy W[ids] (a read, a write and a second read of every chosen expert); inductor only
rewrites such an M=1 bmm into multiply + sum itself under coordinate_descent_tuning, which the
baseline does not set. Either way each (row, slot) reads its expert once: at batch B a layer
reads B*k experts' weights, duplicates included (no de-duplication across rows), which is the
price of static shapes that gpt-fast pays too.

Numerics follow mpk.models.reference (transformers' Qwen3MoeSparseMoeBlock): router logits in
the storage dtype (bf16 when benchmarking), softmax over all experts in fp32, the top k with
ties to the lower expert id, optional renormalisation, weights rounded to the storage dtype;
each expert's SwiGLU rounded like the dense MLP, each product with its weight rounded, the
products summed over the slots in fp32 and rounded once. In float32 every rounding is exact.

Like baseline.py this imports nothing from mpk.graph / mpk.compiler / mpk.tasks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpk.models.config import ModelConfig


def _stacked_view(parts: list[torch.Tensor], shape: tuple[int, ...],
                  dtype: torch.dtype) -> torch.Tensor | None:
    """The buffer `parts` are consecutive row-major slices of, if they are exactly that.

    random_weights lays each layer's experts out as views into [E, 2, I, H] and [E, H, I]
    buffers; reusing them instead of stacking a copy keeps qwen3-30b-a3b's 57 GB of experts on
    the H200 once (the benchmark shares its weights with MPK). Real checkpoints load each
    expert as its own tensor: those get stacked (None here)."""
    base = parts[0]._base
    if base is None or base.dtype != dtype or tuple(base.shape) != shape \
            or not base.is_contiguous():
        return None
    step = parts[0].numel()
    start = base.data_ptr()
    for i, t in enumerate(parts):
        if t._base is not base or t.data_ptr() != start + i * step * t.element_size() \
                or not t.is_contiguous():
            return None
    return base


def stack_experts(cfg: ModelConfig, weights: dict[str, torch.Tensor], layer: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router [E, H], gate_up [E, 2, I, H], down [E, H, I]) of MoE layer `layer` in `dtype`."""
    p = f"model.layers.{layer}.mlp."
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    names = [f"{p}experts.{x}.{proj}_proj.weight" for x in range(e) for proj in ("gate", "up")]
    gate_up = _stacked_view([weights[n] for n in names], (e, 2, inter, h), dtype)
    if gate_up is None:
        gate_up = torch.stack([weights[n].to(dtype) for n in names]).view(e, 2, inter, h)
    downs = [weights[f"{p}experts.{x}.down_proj.weight"] for x in range(e)]
    down = _stacked_view(downs, (e, h, inter), dtype)
    if down is None:
        down = torch.stack([t.to(dtype) for t in downs])
    return weights[p + "gate.weight"].to(dtype), gate_up, down


def route(x: torch.Tensor, router: torch.Tensor, top_k: int,
          norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [B, k] long, weights [B, k] in x's dtype) of the normed rows x [B, H], best
    first.

    A stable descending sort rather than torch.topk: topk leaves the order of equal values
    unspecified, and bf16 router logits tie exactly often enough (8 mantissa bits over 128
    experts) that the baseline must break ties as the reference and MPK do, to the lower id.
    Sorting E (128) values per row is nothing next to the expert weights."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    top, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, ids = top[:, :top_k], ids[:, :top_k]
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return ids, top.to(x.dtype)


def _bmv(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """w [..., N, K] times v [..., K] -> [..., N]: f32 products and sum, see the docstring."""
    return (w.float() * v.float().unsqueeze(-2)).sum(dim=-1)


def moe_mlp(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """The sparse MLP of the normed rows x [B, H] -> [B, H] in x's dtype."""
    ids, weight = route(x, router, top_k, norm_topk_prob)          # [B, k]
    # gate_up[ids] is [B, k, 2, I, H]: each row's k chosen experts' gate and up projections.
    gu = _bmv(gate_up[ids], x[:, None, None, :]).to(x.dtype)      # [B, k, 2, I]
    act = F.silu(gu[:, :, 0]) * gu[:, :, 1]                        # [B, k, I]
    out = _bmv(down[ids], act).to(x.dtype)                         # [B, k, H]
    return (out * weight[..., None]).float().sum(dim=1).to(x.dtype)
