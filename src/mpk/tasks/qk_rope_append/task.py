"""qk_rope_append: per KV-head group, q/k RMSNorm (optional), RoPE, and the KV-cache append.

qkv [B, KVH, (G+2)*D] bf16: for each KV head g, its G query heads, then its key, then its value
(the builder interleaves the fused QKV weight this way so one task owns one group).
q_norm, k_norm [D] bf16 (optional, Qwen3), rope [max_pos, D] f32 (cos in the first D/2 columns,
sin in the last D/2), positions [B] i32 (the position of step 0), page_table [B, max_pages] i32.
Writes q_out [B, KVH, G*D] bf16 and k_cache / v_cache [num_pages, page_size, KVH, D] bf16 at
position p = positions[b] + step: page page_table[b, p // page_size], slot p % page_size.
The grid splits KV heads only (one task handles every row of the batch for its group).
"""

from __future__ import annotations

import torch

from mpk.dtypes import DType
from mpk.tasks.base import Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.numerics import bf16, rmsnorm_rows
from mpk.tasks.registry import register


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the last dim (Hugging Face convention), fp32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@register
class QkRopeAppend(TaskKind):
    name = "qk_rope_append"
    operands = (
        OperandSpec("qkv", Access.READ),
        OperandSpec("q_norm", Access.READ, optional=True, weight=True),
        OperandSpec("k_norm", Access.READ, optional=True, weight=True),
        OperandSpec("rope", Access.READ),
        OperandSpec("positions", Access.READ),
        OperandSpec("page_table", Access.READ),
        OperandSpec("q_out", Access.WRITE),
        OperandSpec("k_cache", Access.WRITE),
        OperandSpec("v_cache", Access.WRITE),
    )
    params = (Param("batch"), Param("group"), Param("head_dim"), Param("kv_heads"),
              Param("page_size"), Param("max_pages"), Param("max_pos"), Param("has_qk_norm"),
              Param("eps", is_float=True), Param("heads_per_task"), Param("num_pages"))
    attrs = {"eps": 1e-6}

    def default_splits(self, grid, tensors):
        return {"qkv": (1, None, None), "q_out": (1, None, None),
                "k_cache": (2, None, None), "v_cache": (2, None, None)}

    def check(self, op: OpView) -> None:
        num_pages, page_size, kv_heads, head_dim = op.shape("k_cache")
        batch = op.shape("qkv")[0]
        width = op.shape("qkv")[2]
        if op.shape("qkv")[1] != kv_heads or width % head_dim or width // head_dim < 3:
            raise op.error(f"qkv {op.shape('qkv')} does not fit KV heads {kv_heads} of dim "
                           f"{head_dim}: expected [B, {kv_heads}, (G+2)*{head_dim}]")
        group = width // head_dim - 2
        op.expect_shape("v_cache", op.shape("k_cache"))
        op.expect_shape("q_out", (batch, kv_heads, group * head_dim))
        op.expect_shape("positions", (batch,))
        if op.shape("page_table")[0] != batch or len(op.shape("page_table")) != 2:
            raise op.error(f"page_table must be [{batch}, max_pages], got {op.shape('page_table')}")
        op.expect_shape("rope", (op.shape("rope")[0], head_dim))
        if head_dim % 2:
            raise op.error(f"head_dim {head_dim} must be even for RoPE")
        if op.has("q_norm") != op.has("k_norm"):
            raise op.error("give both q_norm and k_norm or neither")
        for name in ("q_norm", "k_norm"):
            if op.has(name):
                op.expect_shape(name, (head_dim,))
        for name in ("qkv", "q_out", "k_cache", "v_cache"):
            op.expect_dtype(name, DType.BF16)
        op.expect_dtype("rope", DType.F32)
        op.expect_dtype("positions", DType.I32)
        op.expect_dtype("page_table", DType.I32)
        if op.grid[1] != 1 or op.grid[2] != 1:
            raise op.error("the grid splits KV heads only: use grid (kv_heads or a divisor, 1, 1)")
        op.expect_same_split("qkv", 1, "k_cache", 2)
        op.expect_same_split("qkv", 1, "q_out", 1)
        op.expect_same_split("qkv", 1, "v_cache", 2)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        num_pages, page_size, kv_heads, head_dim = op.shape("k_cache")
        return {"batch": op.shape("qkv")[0], "group": op.shape("qkv")[2] // head_dim - 2,
                "head_dim": head_dim, "kv_heads": kv_heads, "page_size": page_size,
                "max_pages": op.shape("page_table")[1], "max_pos": op.shape("rope")[0],
                "has_qk_norm": int(op.has("q_norm")), "eps": op.attrs["eps"],
                "heads_per_task": op.tile_shape("qkv")[1], "num_pages": num_pages}

    def reference(self, tile: Tile) -> None:
        p = self.param_values(tile.op)
        d, group = p["head_dim"], p["group"]
        heads = tile["qkv"].shape[1]
        for b in range(tile["qkv"].shape[0]):
            pos = int(tile["positions"][b]) + tile.step
            row = tile["qkv"][b].float().reshape(heads, group + 2, d)
            q, k, v = row[:, :group], row[:, group], row[:, group + 1]
            if tile.has("q_norm"):
                q = rmsnorm_rows(q, tile["q_norm"], p["eps"])
                k = rmsnorm_rows(k, tile["k_norm"], p["eps"])
            cos, sin = tile["rope"][pos, : d // 2], tile["rope"][pos, d // 2:]
            tile["q_out"][b].copy_(bf16(rope_rotate(q, cos, sin)).reshape(heads, group * d))
            page = int(tile["page_table"][b, pos // p["page_size"]])
            slot = pos % p["page_size"]
            tile["k_cache"][page, slot].copy_(rope_rotate(k, cos, sin))
            tile["v_cache"][page, slot].copy_(v)

    def cost(self, op: OpView) -> TaskCost:
        batch, _, width = op.tile_shape("qkv")
        heads = op.tile_shape("qkv")[1]
        n = batch * heads * width
        return TaskCost(weight_bytes=0, act_bytes=4 * n, flops=10 * n)
