"""rmsnorm: out[b, :] = bf16(w * bf16(x[b, :] * rsqrt(mean(x[b, :]^2) + eps))).

x, out [B, H] bf16; weight [H] bf16. The grid may split B (rows are independent), never H.
"""

from __future__ import annotations

from mpk.dtypes import DType
from mpk.tasks.base import Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.numerics import rmsnorm_rows
from mpk.tasks.registry import register

POLL_MAX_BYTES = 8 * 1024  # a flagged x: 16-byte vectors, at most two a thread (256 threads)


@register
class RmsNorm(TaskKind):
    name = "rmsnorm"
    operands = (
        OperandSpec("x", Access.READ),
        OperandSpec("weight", Access.READ, weight=True),
        OperandSpec("out", Access.WRITE),
    )
    params = (Param("rows"), Param("hidden"), Param("eps", is_float=True))
    attrs = {"eps": 1e-6}

    def flag_operands(self, op: OpView) -> frozenset[str]:
        # A flagged x is polled by whole 16-byte vectors into the staged rows (sm90.cuh), which
        # every path of the kernel reads; out is written plainly. The polls go one vector a
        # thread after the other, so only up to POLL_MAX_BYTES (two vectors a thread): polled
        # one by one, batch 8's 16 KB cost the linears more than a counted hand-off saved
        # (perf-log, fourteenth session).
        rows, hidden = op.shape("x")
        small = 2 * rows * hidden <= POLL_MAX_BYTES
        return frozenset({"x"}) if hidden % 8 == 0 and small else frozenset()

    def default_splits(self, grid, tensors):
        return {"x": (0, None, None), "out": (0, None, None)}

    def check(self, op: OpView) -> None:
        rows, hidden = op.shape("x")
        op.expect_shape("weight", (hidden,))
        op.expect_shape("out", (rows, hidden))
        for name in ("x", "weight", "out"):
            op.expect_dtype(name, DType.BF16)
        op.expect_unsplit("x", 1)
        op.expect_unsplit("out", 1)
        op.expect_same_split("x", 0, "out", 0)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        return {"rows": op.tile_shape("x")[0], "hidden": op.shape("x")[1], "eps": op.attrs["eps"]}

    def reference(self, tile: Tile) -> None:
        tile["out"].copy_(rmsnorm_rows(tile["x"], tile["weight"], tile.attr("eps")))

    def cost(self, op: OpView) -> TaskCost:
        rows, hidden = op.tile_shape("x")
        return TaskCost(weight_bytes=2 * hidden, act_bytes=4 * rows * hidden, flops=4 * rows * hidden)
