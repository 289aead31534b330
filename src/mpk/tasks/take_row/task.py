"""take_row: out [1, H] = x[n - 1] for x [C, H] and chunk [1] i32 = n (clamped to [1, C]): the
hidden state of a prefill chunk's last prompt position, which alone goes on to lm_head.

With segments (several sequences in one chunk: chunk [S], starts [S], as for rope_append), out
[S, H]: row s is x[starts[s] + n_s - 1], n_s = chunk[s] clamped to [1, C - starts[s]] (starts
clamped to [0, C - 1]). The CUDA kernel takes one segment.
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
        OperandSpec("starts", Access.READ, optional=True),
    )
    params = (Param("rows"), Param("row_bytes"))

    def check(self, op: OpView) -> None:
        rows, hidden = op.shape("x")
        segments = op.shape("chunk")[0] if len(op.shape("chunk")) == 1 else 0
        if segments < 1:
            raise op.error(f"chunk must be [S], got {op.shape('chunk')}")
        op.expect_shape("out", (segments, hidden))
        op.expect_dtype("chunk", DType.I32)
        if op.has("starts"):
            op.expect_shape("starts", (segments,))
            op.expect_dtype("starts", DType.I32)
        elif segments > 1:
            raise op.error(f"{segments} segments need 'starts' (each segment's first row)")
        op.expect_dtype("out", op.tensors["x"].dtype)
        if op.num_tasks != 1:
            raise op.error(f"take_row runs as one task, got grid {op.grid}")

    def param_values(self, op: OpView) -> dict[str, int | float]:
        rows, hidden = op.shape("x")
        return {"rows": rows, "row_bytes": hidden * op.tensors["x"].dtype.itemsize}

    def cuda_unsupported(self, op: OpView) -> str | None:
        if op.shape("chunk")[0] > 1:
            return "the CUDA kernel takes one sequence a chunk (no 'starts' segments yet)"
        return None

    def reference(self, tile: Tile) -> None:
        rows = tile["x"].shape[0]
        for s in range(tile["chunk"].shape[0]):
            start = min(max(int(tile["starts"][s]), 0), rows - 1) if tile.has("starts") else 0
            n = min(max(int(tile["chunk"][s]), 1), rows - start)
            tile["out"][s].copy_(tile["x"][start + n - 1])

    def cost(self, op: OpView) -> TaskCost:
        return TaskCost(weight_bytes=0, act_bytes=4 * op.shape("x")[1], flops=0)
