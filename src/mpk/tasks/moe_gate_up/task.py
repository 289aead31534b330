"""moe_gate_up: the chosen experts' gate and up projections and silu*mul, for every row that
chose them.

x [B, H] bf16 (the router's x_norm), expert_ids [B, K] i32 (the router's), weight [E, 2, I, H]
bf16 (per expert: its gate rows, then its up rows) -> out [B, K, I] bf16:
    out[b, j, n] = bf16(bf16(silu(bf16(x[b] . W[e, 0, n]))) * bf16(x[b] . W[e, 1, n]))
with e = expert_ids[b, j] (numerics.silu_mul: the dense MLP's gate_up epilogue, HF's rounding).

Grid (U, T). Axis 0 is a slot over the step's DISTINCT chosen experts: slot u takes the u-th
smallest expert id that any row chose and computes it for every (b, j) that chose it, so an
expert's weights are read once per step however many rows chose it. U = min(E, B * K), enough
for every distinct expert; slots past the number of distinct experts do nothing. Axis 1 cuts I
into T ranges starting at multiples of 8 (split_align).

Dependencies: the task at (u, t) writes the rows of range t of the (b, j) pairs whose expert is
slot u's, but which pairs those are depends on expert_ids, so its box is out[:, :, range t] for
every u. The slots partition the pairs, so the writes of different slots never meet at run time
(disjoint_writes). Every task reads all of x and expert_ids.

Weights: their address depends on expert_ids, an activation of this step, so the kind has no
weight stream (TaskKind.stream_layout): the kernel reads the chosen experts' rows from global
memory. Streaming them into shared-memory pages through the runtime's loader, as soon as the
router's result is known, is later GPU work (issue 12). An id outside [0, E) (never written by
moe_router) raises IndexError here; the kernel ignores it, except that at batch 1, where its
out is flagged, the words of that pair are then never stored and their reader's poll times out
(a watchdog error, not a wrong answer).

The kernel (sm90.cuh): the ids set bits in a 512-bit map, the slot finds its expert (the u-th
set bit) and lists its pairs; the pairs' x rows are staged MAX_PAIRS at a time (normally one
group: more only when more than MAX_PAIRS rows chose one expert), and each warp computes rows of
the range, gate and up together, with plain fp32 FMA dot products (one per pair and matrix).
"""

from __future__ import annotations

import torch

from mpk.dtypes import DType
from mpk.tasks.base import (
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
from mpk.tasks.moe_router.task import MAX_EXPERTS, MAX_TOP_K
from mpk.tasks.numerics import bf16, silu_mul
from mpk.tasks.registry import register

ALIGN = 8  # intermediate rows per unit of the split (task ranges start at multiples of 8)
X_BUDGET = 96 * 1024  # shared memory for the staged input rows (bytes)
HEADER_BYTES = 2048  # sm90.cuh: expert bitmap, the ids, the (b, j) pairs, their count, xrow
MAX_PAIRS = 8  # sm90.cuh kMaxPairs: input rows staged (and dot products kept) per pass


def expected_distinct(experts: int, top_k: int, batch: int) -> float:
    """Expected number of distinct experts B rows choose, K each, if every row's choice were
    uniform: E (1 - (1 - K/E)^B). Exactly K at batch 1. Real routers are skewed, so this is an
    upper estimate of what a step reads at batch > 1."""
    return experts * (1.0 - (1.0 - top_k / experts) ** batch)


def checked_ids(ids: torch.Tensor, experts: int) -> list[list[int]]:
    """expert_ids as lists; IndexError for an id outside [0, experts) (a poisoned or foreign
    value: the interpreter's stand-in for the out-of-bounds read it would be)."""
    rows = ids.tolist()
    bad = [e for row in rows for e in row if not 0 <= e < experts]
    if bad:
        raise IndexError(f"expert id {bad[0]} is outside [0, {experts})")
    return rows


@register
class MoeGateUp(TaskKind):
    name = "moe_gate_up"
    operands = (
        OperandSpec("x", Access.READ),
        OperandSpec("expert_ids", Access.READ),
        OperandSpec("weight", Access.READ, weight=True),
        OperandSpec("out", Access.WRITE),
    )
    params = (Param("batch"), Param("hidden"), Param("inter"), Param("top_k"),
              Param("num_experts"), Param("tiles"))
    disjoint_writes = ("out",)

    def default_splits(self, grid, tensors):
        return {"out": (None, 2, None)}  # x, expert_ids, weight: whole, every task

    def split_align(self, op: OpView, operand: str) -> int | None:
        return ALIGN if operand == "out" else None

    def check(self, op: OpView) -> None:
        batch, hidden = op.shape("x")
        top_k = op.shape("expert_ids")[1]
        wshape = op.shape("weight")
        if len(wshape) != 4 or wshape[1] != 2 or wshape[3] != hidden:
            raise op.error(f"weight must be [E, 2, I, {hidden}] (each expert's gate and up "
                           f"rows), got {wshape}")
        experts, inter = wshape[0], wshape[2]
        op.expect_shape("expert_ids", (batch, top_k))
        op.expect_shape("out", (batch, top_k, inter))
        for name in ("x", "weight", "out"):
            op.expect_dtype(name, DType.BF16)
        op.expect_dtype("expert_ids", DType.I32)
        if not 1 <= batch <= MAX_BATCH or not 1 <= top_k <= min(experts, MAX_TOP_K) or \
                experts > MAX_EXPERTS:
            raise op.error(f"batch {batch}, {experts} experts, top-{top_k}: the kernel takes 1 to "
                           f"{MAX_BATCH} rows, up to {MAX_EXPERTS} experts, 1 to {MAX_TOP_K} "
                           f"(at most all) per row")
        if hidden % 8 or inter % 8:
            raise op.error(f"hidden {hidden} and expert width {inter} must be multiples of 8")
        if 2 * min(batch, MAX_PAIRS) * hidden > X_BUDGET:
            raise op.error(f"{min(batch, MAX_PAIRS)} rows of {hidden} bf16 exceed the kernel's "
                           f"{X_BUDGET // 1024} KB of staged input")
        if op.grid[0] != min(experts, batch * top_k) or op.grid[2] != 1:
            raise op.error(f"the grid is (min(E, B*K), tiles) = ({min(experts, batch * top_k)}, "
                           f"T): a slot per distinct expert, got {op.grid}")
        op.expect_unsplit("x", 0, 1)
        op.expect_unsplit("expert_ids", 0, 1)
        op.expect_unsplit("weight", 0, 1, 2, 3)
        if op.splits["out"] != (None, 2, None):
            raise op.error(f"out is cut by grid axis 1 along dim 2 (the expert width) only: "
                           f"split (None, 2, None), got {op.splits['out']}")

    def param_values(self, op: OpView) -> dict[str, int | float]:
        batch, hidden = op.shape("x")
        experts, _, inter, _ = op.shape("weight")
        return {"batch": batch, "hidden": hidden, "inter": inter,
                "top_k": op.shape("expert_ids")[1], "num_experts": experts,
                "tiles": op.grid[1]}

    def scratch_bytes(self, op: OpView) -> int:
        # sm90.cuh: the header, the staged x rows, then (a flagged out, batch 1) the range of
        # outputs of up to K pairs (a row may name an expert twice) at a 16-byte boundary
        batch, hidden = op.shape("x")
        xs = -(-2 * min(batch, MAX_PAIRS) * hidden // 16) * 16
        units = -(-op.shape("weight")[2] // ALIGN)  # a range: at most ALIGN x ceil(units / T)
        pairs = op.shape("expert_ids")[1]
        ys = 2 * pairs * ALIGN * -(-units // op.grid[1]) if _flaggable(op) else 0
        return HEADER_BYTES + xs + ys

    def flag_operands(self, op: OpView) -> frozenset[str]:
        # sm90.cuh stores out's words from a shared-memory gather after every read of the task.
        # Batch 1 only: there the K slots and the row's K distinct experts (moe_router's top-k
        # never repeats one) pair one to one, so every task writes its range of one pair in
        # every step, and a reader that saw every word saw every task's writes
        # (compiler/flags.py's premise). At batch > 1 a slot past the step's distinct experts
        # writes nothing, and a reader's polls would not cover it. (Ids with a repeat, which
        # only tests write, leave one slot idle: its task writes nothing and only reads.)
        # x is staged before the ids are polled: sound while the wait on x's writer stays
        # counted (tests/compiler/test_flags.py checks it for the MoE graphs).
        # The ids are polled at batch 1 (moe_router writes them as words there).
        return frozenset({"out", "expert_ids"}) if _flaggable(op) else frozenset()

    def reference(self, tile: Tile) -> None:
        weight = tile["weight"]  # whole [E, 2, I, H]
        rows = checked_ids(tile["expert_ids"], weight.shape[0])
        distinct = sorted({e for row in rows for e in row})
        if tile.point[0] >= len(distinct):
            return
        expert = distinct[tile.point[0]]
        lo, hi = split_bounds(weight.shape[2], tile.op.grid[1], ALIGN, tile.point[1])
        pairs = [(b, j) for b, row in enumerate(rows) for j, e in enumerate(row) if e == expert]
        b = torch.tensor([p[0] for p in pairs])
        j = torch.tensor([p[1] for p in pairs])
        x = tile["x"][b].float()
        gate = bf16(x @ weight[expert, 0, lo:hi].float().T)
        up = bf16(x @ weight[expert, 1, lo:hi].float().T)
        tile["out"][b, j] = silu_mul(gate, up).to(tile["out"].dtype)

    def cost(self, op: OpView) -> TaskCost:
        batch, hidden = op.shape("x")
        experts, _, inter, _ = op.shape("weight")
        top_k = op.shape("expert_ids")[1]
        rows = -(-inter // op.grid[1])
        # Only the chosen experts are read: the expected distinct ones (exactly K at batch 1),
        # spread over the U slots, so the op's tasks add up to their bytes.
        busy = expected_distinct(experts, top_k, batch) / op.grid[0]
        pairs = batch * top_k / op.grid[0]
        return TaskCost(weight_bytes=round(busy * 4 * rows * hidden),
                        act_bytes=2 * batch * hidden + round(pairs * 2 * rows),
                        flops=round(pairs * 4 * rows * hidden))


def _flaggable(op: OpView) -> bool:
    batch = op.shape("x")[0]
    return batch == 1 and op.shape("weight")[2] % 2 == 0
