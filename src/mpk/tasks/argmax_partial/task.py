"""argmax_partial: per vocab slice, the best logit and its global index.

logits [B, V] f32 or bf16 -> part_val [B, T] f32, part_idx [B, T] i32 (T = grid axis 0).
Ties go to the lowest index, as torch.argmax does.
"""

from __future__ import annotations

from mpk.dtypes import DType
from mpk.tasks.base import Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.registry import register


@register
class ArgmaxPartial(TaskKind):
    name = "argmax_partial"
    operands = (
        OperandSpec("logits", Access.READ),
        OperandSpec("part_val", Access.WRITE),
        OperandSpec("part_idx", Access.WRITE),
    )
    params = (Param("batch"), Param("vocab"), Param("tile_v"), Param("num_tiles"),
              Param("logits_f32"))

    def default_splits(self, grid, tensors):
        return {"logits": (1, None, None), "part_val": (1, None, None),
                "part_idx": (1, None, None)}

    def check(self, op: OpView) -> None:
        batch, vocab = op.shape("logits")
        tiles = op.grid[0]
        op.expect_shape("part_val", (batch, tiles))
        op.expect_shape("part_idx", (batch, tiles))
        op.expect_dtype("logits", DType.F32, DType.BF16)
        op.expect_dtype("part_val", DType.F32)
        op.expect_dtype("part_idx", DType.I32)
        if op.grid[1] != 1 or op.grid[2] != 1:
            raise op.error("the grid splits the vocabulary only: grid (tiles, 1, 1)")
        op.expect_same_split("logits", 1, "part_val", 1)
        op.expect_same_split("logits", 1, "part_idx", 1)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        batch, vocab = op.shape("logits")
        return {"batch": batch, "vocab": vocab, "tile_v": vocab // op.grid[0],
                "num_tiles": op.grid[0],
                "logits_f32": int(op.tensors["logits"].dtype is DType.F32)}

    def reference(self, tile: Tile) -> None:
        logits = tile["logits"].float()
        val, idx = logits.max(dim=1)
        tile["part_val"][:, 0].copy_(val)
        tile["part_idx"][:, 0].copy_(idx.int() + tile.point[0] * logits.shape[1])

    def cost(self, op: OpView) -> TaskCost:
        batch, width = op.tile_shape("logits")
        return TaskCost(weight_bytes=0, act_bytes=4 * batch * width, flops=batch * width)
