"""attention_merge: combine the KV-split partials of attention into the normalised output.

part_o [B, KVH, S, G*D] f32, part_lse [B, KVH, S, G] f32 -> out [B, KVH*G*D] bf16:
out = sum_s exp(lse_s - lse) * o_s with lse = log(sum_s exp(lse_s)). Grid: (KV-head tiles, B, 1).
"""

from __future__ import annotations

import torch

from mpk.dtypes import DType
from mpk.tasks.base import Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.registry import register


@register
class AttentionMerge(TaskKind):
    name = "attention_merge"
    operands = (
        OperandSpec("part_o", Access.READ),
        OperandSpec("part_lse", Access.READ),
        OperandSpec("out", Access.WRITE),
    )
    params = (Param("batch"), Param("kv_heads"), Param("num_splits"), Param("group"),
              Param("head_dim"), Param("heads_per_task"), Param("batch_per_task"))

    def default_splits(self, grid, tensors):
        return {"part_o": (1, 0, None), "part_lse": (1, 0, None), "out": (1, 0, None)}

    def check(self, op: OpView) -> None:
        batch, kv_heads, splits, width = op.shape("part_o")
        group = op.shape("part_lse")[3]
        op.expect_shape("part_lse", (batch, kv_heads, splits, group))
        op.expect_shape("out", (batch, kv_heads * width))
        if width % group:
            raise op.error(f"part_o width {width} is not a multiple of the group {group}")
        op.expect_dtype("part_o", DType.F32)
        op.expect_dtype("part_lse", DType.F32)
        op.expect_dtype("out", DType.BF16)
        op.expect_unsplit("part_o", 2, 3)
        op.expect_same_split("part_o", 0, "out", 0)
        op.expect_same_split("part_o", 1, "out", 1)
        op.expect_same_split("part_lse", 1, "out", 1)
        op.expect_same_split("part_lse", 0, "out", 0)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        batch, kv_heads, splits, width = op.shape("part_o")
        group = op.shape("part_lse")[3]
        return {"batch": batch, "kv_heads": kv_heads, "num_splits": splits, "group": group,
                "head_dim": width // group, "heads_per_task": kv_heads // op.grid[0],
                "batch_per_task": op.tile_shape("out")[0]}

    def reference(self, tile: Tile) -> None:
        o, lse = tile["part_o"], tile["part_lse"]  # [b, h, S, G*D], [b, h, S, G]
        b, h, s, width = o.shape
        group = lse.shape[-1]
        total = torch.logsumexp(lse, dim=2, keepdim=True)  # [b, h, 1, G]
        weight = torch.exp(lse - total).nan_to_num(0.0)  # all-empty rows cannot occur (L >= 1)
        o = o.reshape(b, h, s, group, width // group)
        merged = (o * weight[..., None]).sum(dim=2)
        tile["out"].copy_(merged.reshape(b, h * width))

    def cost(self, op: OpView) -> TaskCost:
        b, h, s, width = op.tile_shape("part_o")
        return TaskCost(weight_bytes=0, act_bytes=4 * b * h * s * width, flops=3 * b * h * s * width)
