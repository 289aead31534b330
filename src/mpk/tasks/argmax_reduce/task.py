"""argmax_reduce: the sampled (greedy) token per row from the argmax_partial slices.

part_val [B, T] f32, part_idx [B, T] i32 -> tokens [B] i32 (read by the next step's embedding)
and, optionally, tokens_out [S, B] i32 row `step` (the generated ids of this launch).
"""

from __future__ import annotations

from mpk.dtypes import DType
from mpk.tasks.base import Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.registry import register


@register
class ArgmaxReduce(TaskKind):
    name = "argmax_reduce"
    operands = (
        OperandSpec("part_val", Access.READ),
        OperandSpec("part_idx", Access.READ),
        OperandSpec("tokens", Access.WRITE),
        OperandSpec("tokens_out", Access.WRITE, optional=True),
    )
    params = (Param("batch"), Param("num_tiles"), Param("out_steps"))

    def check(self, op: OpView) -> None:
        batch, tiles = op.shape("part_val")
        op.expect_shape("part_idx", (batch, tiles))
        op.expect_shape("tokens", (batch,))
        op.expect_dtype("part_val", DType.F32)
        op.expect_dtype("part_idx", DType.I32)
        op.expect_dtype("tokens", DType.I32)
        if op.has("tokens_out"):
            op.expect_dtype("tokens_out", DType.I32)
            if op.shape("tokens_out")[1:] != (batch,):
                raise op.error(f"tokens_out must be [steps, {batch}]")
        if op.num_tasks != 1:
            raise op.error("argmax_reduce runs as one task: grid (1, 1, 1)")

    def param_values(self, op: OpView) -> dict[str, int | float]:
        batch, tiles = op.shape("part_val")
        steps = op.shape("tokens_out")[0] if op.has("tokens_out") else 0
        return {"batch": batch, "num_tiles": tiles, "out_steps": steps}

    def reference(self, tile: Tile) -> None:
        best = tile["part_val"].argmax(dim=1)
        tokens = tile["part_idx"].gather(1, best[:, None])[:, 0]
        tile["tokens"].copy_(tokens)
        if tile.has("tokens_out") and tile.step < tile["tokens_out"].shape[0]:
            tile["tokens_out"][tile.step].copy_(tokens)

    def cost(self, op: OpView) -> TaskCost:
        batch, tiles = op.shape("part_val")
        return TaskCost(weight_bytes=0, act_bytes=8 * batch * tiles, flops=batch * tiles)
