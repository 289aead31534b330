"""moe_down: the chosen experts' down projections, weighted, summed and added to the residual.

x [B, K, I] bf16 (moe_gate_up's out), expert_ids [B, K] i32 and expert_weights [B, K] bf16 (the
router's), weight [E, H, I] bf16, residual [B, H] bf16 -> out [B, H] bf16 (out may be the
residual tensor itself: each task reads and writes only its own range):
    t[b, j, n] = bf16(bf16(x[b, j] . W[e, n]) * expert_weights[b, j]),  e = expert_ids[b, j]
    out[b, n]  = bf16(residual[b, n] + bf16(t[b, 0, n] + t[b, 1, n] + ... + t[b, K-1, n]))
with the sum in fp32 in slot order: transformers' grouped_mm experts round each weighted
product to bf16 and sum them in fp32 with one rounding, then the decoder adds the residual.

Grid (T,): T ranges of H starting at multiples of 8 (split_align), one task per SM; every task
reads all of x, expert_ids and expert_weights and the chosen experts' rows of its range.
Weights come from global memory, not a stream, as in moe_gate_up (their address depends on
this step's expert_ids; streaming them through the loader is later GPU work). An id outside
[0, E) raises IndexError here; the kernel skips it.

The kernel (sm90.cuh): per batch row, its K activations staged in shared memory; a warp per
output of the range visits the slots 8 at a time (3 vectors of each chosen row in flight per
lane: qwen3-30b-a3b's I = 768 in one round; 2 of 4 slots was 2.3 us a layer slower, perf-log
nineteenth session), rounds and weights each slot's dot product and adds it to the fp32 sum in
slot order.
An expert two rows chose is read once from HBM and again from L2.
"""

from __future__ import annotations

import torch

from mpk.dtypes import DType
from mpk.tasks.base import (
    FLAG_MAX_BYTES,
    Access,
    OperandSpec,
    OpView,
    Param,
    TaskCost,
    TaskKind,
    Tile,
    split_bounds,
)
from mpk.tasks.linear.task import MAX_BATCH
from mpk.tasks.moe_gate_up.task import checked_ids, expected_distinct
from mpk.tasks.moe_router.task import MAX_EXPERTS, MAX_TOP_K
from mpk.tasks.numerics import bf16
from mpk.tasks.registry import register

ALIGN = 8
X_BUDGET = 64 * 1024  # shared memory for one batch row's K staged expert activations (bytes)
HEADER_BYTES = 2048  # sm90.cuh: the staged ids and weights (B x K each)


@register
class MoeDown(TaskKind):
    name = "moe_down"
    operands = (
        OperandSpec("x", Access.READ),
        OperandSpec("expert_ids", Access.READ),
        OperandSpec("expert_weights", Access.READ),
        OperandSpec("weight", Access.READ, weight=True),
        OperandSpec("residual", Access.READ),
        OperandSpec("out", Access.WRITE),
    )
    params = (Param("batch"), Param("hidden"), Param("inter"), Param("top_k"),
              Param("num_experts"), Param("tasks"))

    def default_splits(self, grid, tensors):
        return {"residual": (1, None, None), "out": (1, None, None)}  # the rest: whole

    def split_align(self, op: OpView, operand: str) -> int | None:
        return ALIGN if operand in ("residual", "out") else None

    def check(self, op: OpView) -> None:
        batch, top_k, inter = op.shape("x")
        wshape = op.shape("weight")
        if len(wshape) != 3 or wshape[2] != inter:
            raise op.error(f"weight must be [E, H, {inter}], got {wshape}")
        experts, hidden = wshape[0], wshape[1]
        op.expect_shape("expert_ids", (batch, top_k))
        op.expect_shape("expert_weights", (batch, top_k))
        op.expect_shape("residual", (batch, hidden))
        op.expect_shape("out", (batch, hidden))
        for name in ("x", "expert_weights", "weight", "residual", "out"):
            op.expect_dtype(name, DType.BF16)
        op.expect_dtype("expert_ids", DType.I32)
        if not 1 <= batch <= MAX_BATCH or not 1 <= top_k <= min(experts, MAX_TOP_K) or \
                experts > MAX_EXPERTS:
            raise op.error(f"batch {batch}, {experts} experts, top-{top_k}: the kernel takes 1 to "
                           f"{MAX_BATCH} rows, up to {MAX_EXPERTS} experts, 1 to {MAX_TOP_K} "
                           f"(at most all) per row")
        if inter % 8:
            raise op.error(f"expert width {inter} must be a multiple of 8 (16-byte vectors)")
        if 2 * top_k * inter > X_BUDGET:
            raise op.error(f"{top_k} expert activations of {inter} bf16 exceed the kernel's "
                           f"{X_BUDGET // 1024} KB of staged input")
        if op.grid[1] != 1 or op.grid[2] != 1:
            raise op.error(f"the grid cuts the hidden dim only: use grid (tasks,), got {op.grid}")
        for name in ("x", "expert_ids", "expert_weights", "weight"):
            op.expect_unsplit(name, *range(len(op.shape(name))))
        for name in ("residual", "out"):
            if op.splits[name] != (1, None, None) and op.grid[0] > 1:
                raise op.error(f"{name} is cut along dim 1 by grid axis 0: split (1, None, "
                               f"None), got {op.splits[name]}")

    def param_values(self, op: OpView) -> dict[str, int | float]:
        batch, top_k, inter = op.shape("x")
        experts, hidden, _ = op.shape("weight")
        return {"batch": batch, "hidden": hidden, "inter": inter, "top_k": top_k,
                "num_experts": experts, "tasks": op.grid[0]}

    def scratch_bytes(self, op: OpView) -> int:
        # sm90.cuh: the header, one row's K activation rows, then (a flagged out) every row's
        # range of outputs at a 16-byte boundary: at most ALIGN x ceil(units / tasks) a row
        batch, top_k, inter = op.shape("x")
        units = -(-op.shape("weight")[1] // ALIGN)
        ys = 2 * batch * ALIGN * -(-units // op.grid[0]) if _flaggable(op) else 0
        return HEADER_BYTES + -(-2 * top_k * inter // 16) * 16 + ys

    def flag_operands(self, op: OpView) -> frozenset[str]:
        # sm90.cuh: the residual's words are polled; out's are stored whole from ys once every
        # row's range is done, after every read of the task's inputs (x, the routing and the
        # residual words, read before the barrier in front of the stores). Only where
        # scratch_bytes reserved ys. x's words are polled at batch 1 (where moe_gate_up writes
        # them: its flag_operands) under the first ids' loads, before any weight load.
        # The ids are polled at batch 1 too (moe_router writes them as words there).
        hidden = frozenset({"residual", "out"}) if _flaggable(op) else frozenset()
        return hidden | {"x", "expert_ids"} if op.shape("x")[0] == 1 else hidden

    def reference(self, tile: Tile) -> None:
        weight = tile["weight"]  # whole [E, H, I]
        experts, hidden, _ = weight.shape
        ids = torch.tensor(checked_ids(tile["expert_ids"], experts))
        lo, hi = split_bounds(hidden, tile.op.grid[0], ALIGN, tile.point[0])
        x = tile["x"].float()
        scale = tile["expert_weights"].float()
        total = torch.zeros(x.shape[0], hi - lo)
        for j in range(x.shape[1]):  # slot order, as the kernel adds them
            rows = weight[ids[:, j], lo:hi].float()  # [B, range, I]
            down = bf16(torch.einsum("bi,bni->bn", x[:, j], rows))
            total = total + bf16(down * scale[:, j, None])
        tile["out"].copy_(bf16(tile["residual"].float() + bf16(total)))

    def cost(self, op: OpView) -> TaskCost:
        batch, top_k, inter = op.shape("x")
        experts, hidden, _ = op.shape("weight")
        rows = -(-hidden // op.grid[0])
        distinct = expected_distinct(experts, top_k, batch)
        # HBM serves each chosen expert's rows once; a row's second use of an expert hits L2
        return TaskCost(weight_bytes=round(distinct * 2 * rows * inter),
                        act_bytes=2 * batch * top_k * inter + 4 * batch * rows,
                        flops=2 * batch * top_k * rows * inter)


def _flaggable(op: OpView) -> bool:
    batch, hidden = op.shape("residual")
    # A flagged out's shared-memory gather (sm90.cuh ys) is reserved only up to what the compiler
    # flags at all, so a larger [B, H] costs no scratch.
    return 2 * batch * hidden <= FLAG_MAX_BYTES and hidden % 2 == 0
