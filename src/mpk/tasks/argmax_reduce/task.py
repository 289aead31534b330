"""argmax_reduce: the sampled token of each row, from lm_head's argmax_partial slices.

part_val [B, T] f32, part_idx [B, T] i32 -> tokens [B] i32 (read by the next step's embedding)
and, optionally, tokens_out [S, B] i32 row `step` (the generated ids of this launch).
The grid is (B,): one task per row, so rows that filter run side by side.

With `logits` [B, V] f32, `sampling` [B, WORDS] i32 and `positions` [B] i32 (and optionally
`runs` [B, 2] i32, tasks/runs.py, which set how far a row's position moves per step), a row whose
sampling words ask for top-k or top-p (tasks/sampling.py) ignores the partials: its task
selects the kept tokens from the row's logits (radix selection over ordered keys, exact integer
masses) and draws the Gumbel-max of logits / T among them, with the same noise as lm_head's
epilogue. Greedy and plain-temperature rows take the partials' winner as before.
"""

from __future__ import annotations

from mpk.dtypes import DType
from mpk.tasks import runs, sampling
from mpk.tasks.base import Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.registry import register

FILTER_OPERANDS = ("logits", "sampling", "positions")


@register
class ArgmaxReduce(TaskKind):
    name = "argmax_reduce"
    operands = (
        OperandSpec("part_val", Access.READ),
        OperandSpec("part_idx", Access.READ),
        OperandSpec("tokens", Access.WRITE),
        OperandSpec("tokens_out", Access.WRITE, optional=True),
        OperandSpec("logits", Access.READ, optional=True),
        OperandSpec("sampling", Access.READ, optional=True),
        OperandSpec("positions", Access.READ, optional=True),
        OperandSpec("runs", Access.READ, optional=True),
    )
    params = (Param("batch"), Param("num_tiles"), Param("out_steps"), Param("vocab"))

    def default_splits(self, grid, tensors):
        row = (0, None, None)
        return {"part_val": row, "part_idx": row, "tokens": row, "tokens_out": (1, None, None),
                "logits": row, "sampling": row, "positions": row,
                "runs": row}

    def check(self, op: OpView) -> None:
        batch, tiles = op.shape("part_val")
        op.expect_shape("part_idx", (batch, tiles))
        op.expect_shape("tokens", (batch,))
        op.expect_dtype("part_val", DType.F32)
        op.expect_dtype("part_idx", DType.I32)
        op.expect_dtype("tokens", DType.I32)
        if op.grid != (batch, 1, 1):
            raise op.error(f"argmax_reduce runs one task per row: grid ({batch},), got {op.grid}")
        for name in ("part_val", "part_idx", "tokens"):
            op.expect_same_split(name, 0, "part_val", 0)
        if op.has("tokens_out"):
            op.expect_dtype("tokens_out", DType.I32)
            if op.shape("tokens_out")[1:] != (batch,):
                raise op.error(f"tokens_out must be [steps, {batch}]")
            op.expect_same_split("tokens_out", 1, "part_val", 0)
        self._check_filter(op, batch)

    def _check_filter(self, op: OpView, batch: int) -> None:
        given = [op.has(name) for name in FILTER_OPERANDS]
        if any(given) and not all(given):
            raise op.error(f"{', '.join(FILTER_OPERANDS)} are given together")
        if op.has("runs") and not all(given):
            raise op.error(f"runs are given with {', '.join(FILTER_OPERANDS)}")
        if not all(given):
            return
        vocab = op.shape("logits")[1]
        op.expect_shape("logits", (batch, vocab))
        op.expect_shape("sampling", (batch, sampling.WORDS))
        op.expect_shape("positions", (batch,))
        op.expect_dtype("logits", DType.F32)
        op.expect_dtype("sampling", DType.I32)
        op.expect_dtype("positions", DType.I32)
        for name in FILTER_OPERANDS:
            op.expect_same_split(name, 0, "part_val", 0)
        if op.has("runs"):
            op.expect_shape("runs", (batch, runs.WORDS))
            op.expect_dtype("runs", DType.I32)
            op.expect_same_split("runs", 0, "part_val", 0)
            op.expect_unsplit("runs", 1)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        batch, tiles = op.shape("part_val")
        steps = op.shape("tokens_out")[0] if op.has("tokens_out") else 0
        vocab = op.shape("logits")[1] if op.has("logits") else 0
        return {"batch": batch, "num_tiles": tiles, "out_steps": steps, "vocab": vocab}

    def reference(self, tile: Tile) -> None:
        token = self._filtered_token(tile)
        if token is None:
            best = tile["part_val"].argmax(dim=1)
            token = int(tile["part_idx"].gather(1, best[:, None])[0, 0])
        tile["tokens"].fill_(token)
        if tile.has("tokens_out") and tile.step < tile["tokens_out"].shape[0]:
            tile["tokens_out"][tile.step].fill_(token)

    @staticmethod
    def _filtered_token(tile: Tile) -> int | None:
        """The token of a top-k / top-p row, None for the other rows."""
        if not tile.has("logits"):
            return None
        row = sampling.RowSampling.decode(tile["sampling"][0].tolist())
        if not row.filters:
            return None
        position = runs.position(int(tile["positions"][0]),
                                 tile["runs"][0] if tile.has("runs") else None, tile.step)
        return sampling.sample_filtered(tile["logits"][0], row, position)

    def scratch_bytes(self, op: OpView) -> int:
        return 4 * 1024  # sm90.cuh: 256 bins, per-warp partials, the picked bin (2.1 KB)

    def cost(self, op: OpView) -> TaskCost:
        _, tiles = op.shape("part_val")
        # Filtering rows are rare; the common cost is the partials.
        return TaskCost(weight_bytes=0, act_bytes=8 * tiles, flops=tiles)
