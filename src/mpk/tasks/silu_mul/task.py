"""silu_mul: out[b, i] = bf16(bf16(silu(x[b, 0, i])) * x[b, 1, i]).

x [B, 2, I] bf16 (gate, up), out [B, I] bf16. The grid splits I.
"""

from __future__ import annotations

from mpk.dtypes import DType
from mpk.tasks.base import Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.numerics import silu_mul
from mpk.tasks.registry import register


@register
class SiluMul(TaskKind):
    name = "silu_mul"
    operands = (OperandSpec("x", Access.READ), OperandSpec("out", Access.WRITE))
    params = (Param("batch"), Param("inter"), Param("tile_i"))

    def default_splits(self, grid, tensors):
        return {"x": (2, None, None), "out": (1, None, None)}

    def check(self, op: OpView) -> None:
        batch, two, inter = op.shape("x")
        if two != 2:
            raise op.error(f"x must be [B, 2, I] (gate, up), got {op.shape('x')}")
        op.expect_shape("out", (batch, inter))
        op.expect_dtype("x", DType.BF16)
        op.expect_dtype("out", DType.BF16)
        op.expect_unsplit("x", 0, 1)
        op.expect_unsplit("out", 0)
        op.expect_same_split("x", 2, "out", 1)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        batch, _, inter = op.shape("x")
        return {"batch": batch, "inter": inter, "tile_i": op.tile_shape("out")[1]}

    def reference(self, tile: Tile) -> None:
        x = tile["x"]
        tile["out"].copy_(silu_mul(x[:, 0], x[:, 1]))

    def cost(self, op: OpView) -> TaskCost:
        n = op.tile_shape("out")[0] * op.tile_shape("out")[1]
        return TaskCost(weight_bytes=0, act_bytes=6 * n, flops=6 * n)
