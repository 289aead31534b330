"""take_row: out [1, H] = x[n - 1] for x [C, H] and chunk [1] i32 = n (clamped to [1, C]): the
hidden state of a prefill chunk's last prompt position, which alone goes on to lm_head.

"""

from __future__ import annotations

from mpk.dtypes import DType
from mpk.tasks.base import Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.registry import register


@register
class TakeRow(TaskKind):
    name = "take_row"
    operands = (
        OperandSpec("x", Access.READ),
        OperandSpec("chunk", Access.READ),
        OperandSpec("out", Access.WRITE),
    )
    params = (Param("rows"), Param("row_bytes"))

    def check(self, op: OpView) -> None:
        rows, hidden = op.shape("x")
        op.expect_shape("chunk", (1,))
        op.expect_shape("out", (1, hidden))
        op.expect_dtype("chunk", DType.I32)
        op.expect_dtype("out", op.tensors["x"].dtype)
        if op.num_tasks != 1:
            raise op.error(f"take_row runs as one task, got grid {op.grid}")

    def param_values(self, op: OpView) -> dict[str, int | float]:
        rows, hidden = op.shape("x")
        return {"rows": rows, "row_bytes": hidden * op.tensors["x"].dtype.itemsize}

    def reference(self, tile: Tile) -> None:
        rows = tile["x"].shape[0]
        n = min(max(int(tile["chunk"][0]), 1), rows)
        tile["out"][0].copy_(tile["x"][n - 1])

    def cost(self, op: OpView) -> TaskCost:
        return TaskCost(weight_bytes=0, act_bytes=4 * op.shape("x")[1], flops=0)
