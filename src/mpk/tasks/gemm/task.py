"""gemm: out = epilogue(prologue(x) @ weight^T) over many rows: a prefill chunk's projections.

The same arithmetic as `linear` (tasks/linear: prologues none / rmsnorm, epilogues none /
silu_mul, an optional residual, fp32 accumulation, the same rounding points), for x [M, K] with
any M: the rows are a chunk of one sequence's prompt positions (models/prefill.py), not decode
batch rows, so M is not bounded by the decode kernel's 16 rows. The grid (T,) cuts the N outputs
into T contiguous ranges (split_bounds, multiples of 8; 4 for silu_mul).

Semantics only for now: the CPU interpreter runs it; the CUDA kernel (GEMM tiles on tensor
cores, weights streamed once per tile column) is not written, so the CUDA backend does not
build prefill plans and its engine feeds prompts as runs of the decode batch instead.
"""

from __future__ import annotations

from mpk.dtypes import DType
from mpk.tasks.base import Access, OpView, OperandSpec, TaskCost, TaskKind, Tile, split_bounds
from mpk.tasks.linear.task import project
from mpk.tasks.registry import register

PROLOGUES = ("none", "rmsnorm")
EPILOGUES = ("none", "silu_mul")
ALIGN = 8


@register
class Gemm(TaskKind):
    name = "gemm"
    operands = (
        OperandSpec("x", Access.READ),
        OperandSpec("norm_weight", Access.READ, optional=True, weight=True),
        OperandSpec("weight", Access.READ, weight=True),
        OperandSpec("residual", Access.READ, optional=True),
        OperandSpec("out", Access.WRITE),
    )
    attrs = {"prologue": "none", "epilogue": "none", "eps": 1e-6}

    def default_splits(self, grid, tensors):
        row_dim = len(tensors["weight"].shape) - 2
        return {"weight": (row_dim, None, None), "out": (1, None, None),
                "residual": (1, None, None)}

    def split_align(self, op: OpView, operand: str) -> int | None:
        if operand in ("weight", "out", "residual"):
            return ALIGN // 2 if op.attrs["epilogue"] == "silu_mul" else ALIGN
        return None

    def check(self, op: OpView) -> None:
        prologue, epilogue = op.attrs["prologue"], op.attrs["epilogue"]
        if prologue not in PROLOGUES or epilogue not in EPILOGUES:
            raise op.error(f"prologue {prologue!r} / epilogue {epilogue!r}: use one of "
                           f"{PROLOGUES} / {EPILOGUES}")
        wshape = op.shape("weight")
        silu = epilogue == "silu_mul"
        if (silu and (len(wshape) != 3 or wshape[0] != 2)) or (not silu and len(wshape) != 2):
            raise op.error(f"weight must be [N, K] ([2, N, K] with silu_mul), got {wshape}")
        n, k = wshape[-2], wshape[-1]
        rows = op.shape("x")[0]
        op.expect_shape("x", (rows, k))
        op.expect_shape("out", (rows, n))
        for name in ("x", "weight", "out"):
            op.expect_dtype(name, DType.BF16)
        if (prologue == "rmsnorm") != op.has("norm_weight"):
            raise op.error("norm_weight is given exactly when prologue='rmsnorm'")
        if op.has("norm_weight"):
            op.expect_shape("norm_weight", (k,))
            op.expect_dtype("norm_weight", DType.BF16)
        if op.has("residual"):
            if silu:
                raise op.error("a residual is added only with epilogue 'none'")
            op.expect_shape("residual", (rows, n))
            op.expect_dtype("residual", DType.BF16)
        if op.grid[1] != 1 or op.grid[2] != 1:
            raise op.error(f"the grid cuts the outputs only: use grid (tasks,), got {op.grid}")
        if op.axis_of("weight", len(wshape) - 2) != op.axis_of("out", 1):
            raise op.error("weight rows (dim -2) and out dim 1 must be split by the same axis")
        op.expect_unsplit("x", 0, 1)
        op.expect_unsplit("out", 0)

    def reference(self, tile: Tile) -> None:
        project(tile)

    def cost(self, op: OpView) -> TaskCost:
        wshape = op.shape("weight")
        n, k = wshape[-2], wshape[-1]
        mats = 2 if op.attrs["epilogue"] == "silu_mul" else 1
        align = self.split_align(op, "weight") or ALIGN
        lo, hi = split_bounds(n, op.grid[0], align, 0)
        rows = op.shape("x")[0]
        return TaskCost(weight_bytes=2 * mats * (hi - lo) * k,
                        act_bytes=2 * rows * (k + 2 * (hi - lo)),
                        flops=2 * rows * mats * (hi - lo) * k)
