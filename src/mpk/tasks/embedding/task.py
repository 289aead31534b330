"""embedding: out[b, :] = table[token_b, :], token_b = prompt[step, b] if that is >= 0 else tokens[b].

tokens [B] i32 (last step's sampled ids), prompt [S, B] i32 optional (forced ids, -1 = sample),
table [V, H] bf16, out [B, H] bf16. The grid splits H (table dim 1 and out dim 1).
"""

from __future__ import annotations

import torch

from mpk.dtypes import DType
from mpk.tasks.base import Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.registry import register


def select_tokens(tile: Tile) -> torch.Tensor:
    """The token id each row embeds at this step (prompt overrides the sampled token)."""
    tokens = tile["tokens"].long().clone()
    if tile.has("prompt") and tile.step < tile["prompt"].shape[0]:
        forced = tile["prompt"][tile.step].long()
        tokens = torch.where(forced >= 0, forced, tokens)
    return tokens


@register
class Embedding(TaskKind):
    name = "embedding"
    operands = (
        OperandSpec("tokens", Access.READ),
        OperandSpec("prompt", Access.READ, optional=True),
        OperandSpec("table", Access.READ),
        OperandSpec("out", Access.WRITE),
    )
    params = (Param("batch"), Param("vocab"), Param("hidden"), Param("tile_h"),
              Param("prompt_steps"))

    def default_splits(self, grid, tensors):
        return {"table": (1, None, None), "out": (1, None, None)}

    def check(self, op: OpView) -> None:
        batch = op.shape("tokens")[0]
        vocab, hidden = op.shape("table")
        op.expect_shape("tokens", (batch,))
        op.expect_dtype("tokens", DType.I32)
        op.expect_shape("out", (batch, hidden))
        op.expect_dtype("table", DType.BF16)
        op.expect_dtype("out", DType.BF16)
        if op.has("prompt"):
            op.expect_dtype("prompt", DType.I32)
            if op.shape("prompt")[1:] != (batch,):
                raise op.error(f"prompt must be [steps, {batch}], got {op.shape('prompt')}")
            op.expect_unsplit("prompt", 0, 1)
        op.expect_unsplit("tokens", 0)
        op.expect_unsplit("table", 0)
        op.expect_unsplit("out", 0)
        op.expect_same_split("table", 1, "out", 1)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        vocab, hidden = op.shape("table")
        return {"batch": op.shape("tokens")[0], "vocab": vocab, "hidden": hidden,
                "tile_h": op.tile_shape("out")[1],
                "prompt_steps": op.shape("prompt")[0] if op.has("prompt") else 0}

    def flag_operands(self, op: OpView) -> frozenset[str]:
        # Whole bf16 pairs: tiles of an even width (each starts at a multiple of its width).
        return frozenset({"out"}) if op.tile_shape("out")[1] % 2 == 0 else frozenset()

    def reference(self, tile: Tile) -> None:
        tokens = select_tokens(tile).clamp(0, tile["table"].shape[0] - 1)
        tile["out"].copy_(tile["table"][tokens])

    def cost(self, op: OpView) -> TaskCost:
        rows = op.shape("tokens")[0] * op.tile_shape("out")[1] * 2
        return TaskCost(weight_bytes=0, act_bytes=2 * rows, flops=0)
