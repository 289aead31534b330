"""moe_router: a MoE layer's routing from its router logits (Qwen3-MoE).

logits [B, E] bf16 -> expert_ids [B, K] i32 and expert_weights [B, K] bf16. The router's steps,
as transformers' Qwen3MoeTopKRouter on a bf16 model:
  1. x_norm = the post-attention RMSNorm of the row (an rmsnorm op: the experts read it);
  2. logits = bf16(x_norm @ weight^T) (HF's bf16 router linear rounds them): a linear op with
     an rmsnorm prologue, spread over SMs like the others (models/moe.py add_router);
  then this kind, per row:
  3. probs = softmax(logits) in fp32 over all E experts;
  4. the K largest probabilities, ties to the lower expert id (torch.topk on CUDA and a stable
     descending sort agree on that; the reference model sorts the same way as this kind's
     model's, and only decides exact ties);
  5. with `renormalize` (norm_topk_prob) divided by their sum, added in slot order in fp32;
  6. rounded to bf16 -> expert_weights (HF casts them to the activation dtype).
Grid (B,): one task per row (E probabilities: a small task). Before, one task per row also
normed the row and read the whole gate (E x H bf16: 512 KB per layer of qwen3-30b-a3b) on one
SM: ~65 us per layer on the H200 at batch 1.
The ids and weights drive moe_gate_up and moe_down (ids in [0, E), distinct within a row).

The kernel (sm90.cuh): warp 0 reads the row's logits into registers (all loads in flight at
once) and computes the softmax; then every thread ranks experts against all the (probability,
lower id first) keys at once, and the ranks below K are the slots.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from mpk.dtypes import DType
from mpk.tasks.base import Access, OperandSpec, OpView, Param, TaskCost, TaskKind, Tile
from mpk.tasks.numerics import bf16
from mpk.tasks.registry import register

MAX_EXPERTS = 512  # the kernels keep one bit per expert in 16 words, one prob per expert
MAX_TOP_K = 8  # the kernels unroll over the chosen experts (Qwen3-MoE routes to 8)
ROW_OPERANDS = ("logits", "expert_ids", "expert_weights")


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
    """(ids [N, K] int64, weights [N, K] fp32 holding bf16 values) of logits [N, E]: steps 3
    to 6 of the module docstring."""
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
        OperandSpec("logits", Access.READ),
        OperandSpec("expert_ids", Access.WRITE),
        OperandSpec("expert_weights", Access.WRITE),
    )
    params = (Param("batch"), Param("num_experts"), Param("top_k"), Param("renormalize"))
    attrs: ClassVar[Mapping[str, Any]] = {"renormalize": False}
    # sm90.cuh keeps a lane's experts (l, l + 32, ...) in this many registers; every plan with a
    # router sets it (cuda_constants), so the default only shapes builds of all kinds without a
    # plan (tests/cuda/test_nvcc_build.py): 128 experts, Qwen3-MoE's (at MAX_EXPERTS' 16 a
    # lane that build spilled 32 reloads in the softmax, nineteenth session)
    cuda_defaults = {"ROUTER_EXPERTS_PER_LANE": 4}

    def cuda_constants(self, op: OpView, flagged: frozenset[str] = frozenset()
                       ) -> dict[str, int]:
        return {"ROUTER_EXPERTS_PER_LANE": -(-op.shape("logits")[1] // 32)}

    def flag_operands(self, op: OpView) -> frozenset[str]:
        # Warp 0 polls every word of its row's logits (sm90.cuh step 1), on every path: the
        # router gate (a linear) writes them as flagged words, so the router starts as soon
        # as the gate's last store lands, without the gate's fence and counter in between.
        # At batch 1 the ids are stored as flagged words too (step 3), which moe_gate_up and
        # moe_down poll.
        return frozenset({"logits", "expert_ids"} if op.shape("logits")[0] == 1 else {"logits"})

    def default_splits(self, grid, tensors):
        return {name: (0, None, None) for name in ROW_OPERANDS}

    def check(self, op: OpView) -> None:
        batch, experts = op.shape("logits")
        top_k = op.shape("expert_ids")[1]
        op.expect_shape("expert_ids", (batch, top_k))
        op.expect_shape("expert_weights", (batch, top_k))
        for name in ("logits", "expert_weights"):
            op.expect_dtype(name, DType.BF16)
        op.expect_dtype("expert_ids", DType.I32)
        if not 1 <= top_k <= min(experts, MAX_TOP_K) or experts > MAX_EXPERTS:
            raise op.error(f"{experts} experts, top-{top_k}: the kernels take up to "
                           f"{MAX_EXPERTS} experts and 1 to {MAX_TOP_K} (at most all) per row")
        if op.grid != (batch, 1, 1):
            raise op.error(f"moe_router runs one task per row: grid ({batch},), got {op.grid}")
        for name in ROW_OPERANDS:
            op.expect_same_split(name, 0, "logits", 0)
            op.expect_unsplit(name, 1)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        batch, experts = op.shape("logits")
        return {"batch": batch, "num_experts": experts, "top_k": op.shape("expert_ids")[1],
                "renormalize": int(bool(op.attrs["renormalize"]))}

    def scratch_bytes(self, op: OpView) -> int:
        experts = op.shape("logits")[1]
        return 4 * (-(-experts // 4) * 4) + 8 * MAX_TOP_K  # sm90.cuh: keys, top_p, top_id

    def reference(self, tile: Tile) -> None:
        ids, weights = route(tile["logits"].float(), tile["expert_ids"].shape[1],
                             bool(tile.attr("renormalize")))
        tile["expert_ids"].copy_(ids)
        tile["expert_weights"].copy_(weights)

    def cost(self, op: OpView) -> TaskCost:
        experts, top_k = op.shape("logits")[1], op.shape("expert_ids")[1]
        return TaskCost(weight_bytes=0, act_bytes=2 * experts + 6 * top_k,
                        flops=8 * experts * (1 + top_k))
