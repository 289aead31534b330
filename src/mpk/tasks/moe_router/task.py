"""moe_router: the router of a mixture-of-experts layer, one task per batch row.

x [B, H] bf16 (the residual stream), norm_weight [H] bf16 (the post-attention RMSNorm), weight
[E, H] bf16 (the router gate) -> x_norm [B, H] bf16 (the normed rows the experts read),
expert_ids [B, K] i32 and expert_weights [B, K] bf16. Per row, as transformers'
Qwen3MoeTopKRouter on a bf16 model:
  1. x_norm = RMSNorm(x) (numerics.rmsnorm_rows, as the dense MLP's fused prologue);
  2. logits = bf16(x_norm @ weight^T) (HF's bf16 router linear rounds them);
  3. probs = softmax(logits) in fp32 over all E experts;
  4. the K largest probabilities, best first; equal probabilities: the lower expert id first
     (torch.topk leaves that order unspecified; the rule here is the kernels' and the reference
     model's, and only decides exact ties);
  5. with `renormalize` (norm_topk_prob) divided by their sum, added in slot order in fp32;
  6. rounded to bf16 -> expert_weights (HF casts them to the activation dtype).
Grid (B,): one task per row. Every task reads the whole gate (E x H bf16: 512 KB per layer of
qwen3-30b-a3b) on one SM, so at batch 1 the router is one serial task per MoE layer; splitting
its GEMV over SMs (a linear op spread like the others, its bf16 output is exactly step 2's
rounding point, then a small top-k) is the GPU work that decides whether that matters.
The ids and weights drive moe_gate_up and moe_down (ids in [0, E), distinct within a row).

The kernel (sm90.cuh): the row staged in shared memory, a warp per expert at a time for the
logits (8 gate vectors in flight per lane), then warp 0 alone for the softmax and K rounds of a
warp argmax over (probability, lower id first) keys; scratch_bytes below is its layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from mpk.dtypes import DType
from mpk.tasks.base import Access, OperandSpec, OpView, Param, TaskCost, TaskKind, Tile
from mpk.tasks.numerics import bf16, rmsnorm_rows
from mpk.tasks.registry import register

MAX_EXPERTS = 512  # the kernels keep one bit per expert in 16 words, one prob per expert
MAX_TOP_K = 8  # the kernels unroll over the chosen experts (Qwen3-MoE routes to 8)
ROW_OPERANDS = ("x", "x_norm", "expert_ids", "expert_weights")


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
    """(ids [N, K] int64, weights [N, K] fp32 holding bf16 values) of fp32 logits [N, E]:
    steps 3 to 6 of the module docstring."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, ids = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties: lower id first
    top, ids = top[:, :top_k], ids[:, :top_k]
    if renormalize:
        total = top[:, 0].clone()
        for j in range(1, top_k):  # slot order, as the kernel adds them
            total += top[:, j]
        top = top / total[:, None]
    return ids, bf16(top)


@register
class MoeRouter(TaskKind):
    name = "moe_router"
    operands = (
        OperandSpec("x", Access.READ),
        OperandSpec("norm_weight", Access.READ, weight=True),
        OperandSpec("weight", Access.READ, weight=True),
        OperandSpec("x_norm", Access.WRITE),
        OperandSpec("expert_ids", Access.WRITE),
        OperandSpec("expert_weights", Access.WRITE),
    )
    params = (Param("batch"), Param("hidden"), Param("num_experts"), Param("top_k"),
              Param("renormalize"), Param("eps", is_float=True))
    attrs: ClassVar[Mapping[str, Any]] = {"eps": 1e-6, "renormalize": False}

    def default_splits(self, grid, tensors):
        return {name: (0, None, None) for name in ROW_OPERANDS}

    def check(self, op: OpView) -> None:
        batch, hidden = op.shape("x")
        experts, top_k = op.shape("weight")[0], op.shape("expert_ids")[1]
        op.expect_shape("norm_weight", (hidden,))
        op.expect_shape("weight", (experts, hidden))
        op.expect_shape("x_norm", (batch, hidden))
        op.expect_shape("expert_ids", (batch, top_k))
        op.expect_shape("expert_weights", (batch, top_k))
        for name in ("x", "norm_weight", "weight", "x_norm", "expert_weights"):
            op.expect_dtype(name, DType.BF16)
        op.expect_dtype("expert_ids", DType.I32)
        if not 1 <= top_k <= min(experts, MAX_TOP_K) or experts > MAX_EXPERTS:
            raise op.error(f"{experts} experts, top-{top_k}: the kernels take up to "
                           f"{MAX_EXPERTS} experts and 1 to {MAX_TOP_K} (at most all) per row")
        if hidden % 8:
            raise op.error(f"hidden {hidden} must be a multiple of 8 (16-byte vectors)")
        if op.grid != (batch, 1, 1):
            raise op.error(f"moe_router runs one task per row: grid ({batch},), got {op.grid}")
        for name in ROW_OPERANDS:
            op.expect_same_split(name, 0, "x", 0)
            op.expect_unsplit(name, 1)
        op.expect_unsplit("weight", 0, 1)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        batch, hidden = op.shape("x")
        return {"batch": batch, "hidden": hidden, "num_experts": op.shape("weight")[0],
                "top_k": op.shape("expert_ids")[1],
                "renormalize": int(bool(op.attrs["renormalize"])), "eps": op.attrs["eps"]}

    def scratch_bytes(self, op: OpView) -> int:
        # sm90.cuh: the row (H bf16, 16-byte rounded), 8 warp sums, E probabilities
        return -(-op.shape("x")[1] * 2 // 16) * 16 + 64 + 4 * op.shape("weight")[0]

    def reference(self, tile: Tile) -> None:
        normed = rmsnorm_rows(tile["x"], tile["norm_weight"], tile.attr("eps"))
        tile["x_norm"].copy_(normed)
        logits = bf16(normed @ tile["weight"].float().T)
        ids, weights = route(logits, tile["expert_ids"].shape[1], bool(tile.attr("renormalize")))
        tile["expert_ids"].copy_(ids)
        tile["expert_weights"].copy_(weights)

    def cost(self, op: OpView) -> TaskCost:
        batch, hidden = op.shape("x")
        gate = 2 * op.shape("weight")[0] * hidden
        # Every row's task reads the whole gate, but HBM serves it once per step (the other rows
        # hit L2): the weight-read floor counts it once, the rest is L2 traffic.
        return TaskCost(weight_bytes=-(-gate // batch) + 2 * hidden,
                        act_bytes=gate - -(-gate // batch) + 6 * hidden,
                        flops=gate + 8 * hidden)
