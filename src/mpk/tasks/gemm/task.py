"""gemm: out = epilogue(x @ weight^T) over many rows: a prefill chunk's projections.

The same arithmetic as `linear` without a prologue (tasks/linear: epilogues none / silu_mul, an
optional residual, fp32 accumulation, the same rounding points), for x [M, K] with any M: the
rows are a chunk of one sequence's prompt positions (models/prefill.py), not decode batch rows,
so M is not bounded by the decode kernel's 16 rows. The input norm is a separate `rmsnorm` op
(one pass over the rows, where a prologue would renormalise every row in every column task).

Grid (T, R): axis 0 cuts the N outputs into T contiguous ranges (split_bounds, multiples of 8;
with silu_mul, N is the intermediate size and a range covers the same rows of the gate and the
up matrix); axis 1 cuts the M rows of x, out and residual into R blocks the same way. The CUDA
kernel (sm90.cuh) computes tiles of 128 rows x BN weight rows with warpgroup MMAs (wgmma),
reading both operands through L2 with cp.async (the weights of a range are read once per row
block); BN is 256 where a task's range is wider than 128 outputs (64 with silu_mul), else 128.
"""

from __future__ import annotations

from mpk.dtypes import DType
from mpk.tasks.base import (Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile,
                            split_bounds)
from mpk.tasks.linear.task import project
from mpk.tasks.registry import register

EPILOGUES = ("none", "silu_mul")
ALIGN = 8
# The CUDA tile (sm90.cuh): BM rows x BN weight rows, K in BK steps, STAGES copies in flight;
# BN is BN_WIDE for a task whose range is wider than BN_NARROW weight rows, else BN_NARROW.
BM, BK, STAGES = 128, 64, 3
BN_WIDE, BN_NARROW = 256, 128
SWIZZLE_ALIGN = 1024  # the stages start on a swizzle atom: slack to align the scratch up


def tile_width(outputs: int, silu: bool) -> int:
    """The weight rows of the kernel's tile for a task of `outputs` outputs (sm90.cuh run_task):
    a silu_mul tile holds BN / 2 gate rows and the same up rows."""
    per_output = 2 if silu else 1
    return BN_WIDE if outputs * per_output > BN_NARROW else BN_NARROW


def stage_bytes(bn: int) -> int:
    """Both operands' k tile (BM + bn rows of BK bf16, 128-byte-swizzled rows)."""
    return (BM + bn) * BK * 2


@register
class Gemm(TaskKind):
    name = "gemm"
    operands = (
        OperandSpec("x", Access.READ),
        OperandSpec("weight", Access.READ, weight=True),
        OperandSpec("residual", Access.READ, optional=True),
        OperandSpec("out", Access.WRITE),
    )
    params = (Param("rows"), Param("row_blocks"), Param("k"), Param("n"), Param("tasks"),
              Param("silu"), Param("has_residual"))
    attrs = {"epilogue": "none"}
    wgmma_pipeline = True

    def default_splits(self, grid, tensors):
        row_dim = len(tensors["weight"].shape) - 2
        return {"x": (None, 0, None), "weight": (row_dim, None, None), "out": (1, 0, None),
                "residual": (1, 0, None)}

    def split_align(self, op: OpView, operand: str) -> int | None:
        return ALIGN  # outputs and rows alike (sm90.cuh computes the same split_bounds)

    def check(self, op: OpView) -> None:
        epilogue = op.attrs["epilogue"]
        if epilogue not in EPILOGUES:
            raise op.error(f"epilogue {epilogue!r}: use one of {EPILOGUES}")
        wshape = op.shape("weight")
        silu = epilogue == "silu_mul"
        if (silu and (len(wshape) != 3 or wshape[0] != 2)) or (not silu and len(wshape) != 2):
            raise op.error(f"weight must be [N, K] ([2, N, K] with silu_mul), got {wshape}")
        n, k = wshape[-2], wshape[-1]
        if n % ALIGN or k % 8:
            raise op.error(f"N = {n} and K = {k} must be multiples of {ALIGN} and 8")
        rows = op.shape("x")[0]
        op.expect_shape("x", (rows, k))
        op.expect_shape("out", (rows, n))
        for name in ("x", "weight", "out"):
            op.expect_dtype(name, DType.BF16)
        if op.has("residual"):
            if silu:
                raise op.error("a residual is added only with epilogue 'none'")
            op.expect_shape("residual", (rows, n))
            op.expect_dtype("residual", DType.BF16)
        if op.grid[2] != 1:
            raise op.error(f"the grid is (output ranges, row blocks), got {op.grid}")
        if op.axis_of("weight", len(wshape) - 2) != op.axis_of("out", 1):
            raise op.error("weight rows (dim -2) and out dim 1 must be split by the same axis")
        op.expect_unsplit("x", 1)
        op.expect_same_split("x", 0, "out", 0)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        wshape = op.shape("weight")
        return {"rows": op.shape("x")[0], "row_blocks": op.grid[1], "k": wshape[-1],
                "n": wshape[-2],
                "tasks": op.grid[0], "silu": int(op.attrs["epilogue"] == "silu_mul"),
                "has_residual": int(op.has("residual"))}

    def scratch_bytes(self, op: OpView) -> int:
        # The widest task's tile: its STAGES k tiles (the epilogue stores from registers).
        n, tasks = op.shape("weight")[-2], op.grid[0]
        widest = max(hi - lo for lo, hi in (split_bounds(n, tasks, ALIGN, t) for t in range(tasks)))
        bn = tile_width(widest, op.attrs["epilogue"] == "silu_mul")
        return STAGES * stage_bytes(bn) + SWIZZLE_ALIGN

    def reference(self, tile: Tile) -> None:
        project(tile, tile["x"].float())

    def cost(self, op: OpView) -> TaskCost:
        wshape = op.shape("weight")
        n, k = wshape[-2], wshape[-1]
        mats = 2 if op.attrs["epilogue"] == "silu_mul" else 1
        lo, hi = split_bounds(n, op.grid[0], ALIGN, 0)
        rows = -(-op.shape("x")[0] // op.grid[1])
        return TaskCost(weight_bytes=2 * mats * (hi - lo) * k,
                        act_bytes=2 * rows * (k + 2 * (hi - lo)),
                        flops=2 * rows * mats * (hi - lo) * k)
