"""attention: decode attention for one KV-head group, one batch row and one KV split.

q [B, KVH, G*D] bf16 (G query heads share each KV head: GQA), k_cache / v_cache
[num_pages, page_size, KVH, D] bf16, page_table [B, max_pages] i32, positions [B] i32.
Row b attends to positions 0 .. L-1 with L = positions[b] + step + 1. With S splits (grid axis 2)
split s covers positions [s*c, min(L, (s+1)*c)), c = ceil(L / S), and writes fp32 partials
part_o [B, KVH, S, G*D] and part_lse [B, KVH, S, G] (natural-log sum-exp; -inf when empty) for
attention_merge. With one split it writes the normalised result out [B, KVH, G*D] bf16 directly.
Grid: (KV-head tiles, B, S).
"""

from __future__ import annotations

import math

import torch

from mpk.dtypes import DType
from mpk.tasks.base import Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.registry import register


@register
class Attention(TaskKind):
    name = "attention"
    operands = (
        OperandSpec("q", Access.READ),
        OperandSpec("k_cache", Access.READ),
        OperandSpec("v_cache", Access.READ),
        OperandSpec("page_table", Access.READ),
        OperandSpec("positions", Access.READ),
        OperandSpec("out", Access.WRITE, optional=True),
        OperandSpec("part_o", Access.WRITE, optional=True),
        OperandSpec("part_lse", Access.WRITE, optional=True),
    )
    params = (Param("batch"), Param("group"), Param("head_dim"), Param("kv_heads"),
              Param("page_size"), Param("max_pages"), Param("num_splits"),
              Param("heads_per_task"), Param("scale", is_float=True), Param("batch_per_task"),
              Param("num_pages"))
    attrs = {"scale": 0.0}  # 0 means head_dim ** -0.5

    def default_splits(self, grid, tensors):
        return {"q": (1, 0, None), "k_cache": (2, None, None), "v_cache": (2, None, None),
                "page_table": (None, 0, None), "positions": (None, 0, None),
                "out": (1, 0, None), "part_o": (1, 0, 2), "part_lse": (1, 0, 2)}

    def check(self, op: OpView) -> None:
        num_pages, page_size, kv_heads, head_dim = op.shape("k_cache")
        batch = op.shape("q")[0]
        op.expect_shape("v_cache", op.shape("k_cache"))
        if op.shape("q")[1] != kv_heads or op.shape("q")[2] % head_dim:
            raise op.error(f"q {op.shape('q')} must be [B, {kv_heads}, G*{head_dim}]")
        group = op.shape("q")[2] // head_dim
        if head_dim not in (64, 128):
            raise op.error(f"head_dim {head_dim} is not supported (the kernels do 64 and 128)")
        op.expect_shape("positions", (batch,))
        splits = op.grid[2]
        if splits == 1:
            if not op.has("out") or op.has("part_o") or op.has("part_lse"):
                raise op.error("with one KV split give 'out' (and no partials)")
            op.expect_shape("out", op.shape("q"))
            op.expect_dtype("out", DType.BF16)
        else:
            if op.has("out") or not (op.has("part_o") and op.has("part_lse")):
                raise op.error("with several KV splits give 'part_o' and 'part_lse' (no 'out')")
            op.expect_shape("part_o", (batch, kv_heads, splits, group * head_dim))
            op.expect_shape("part_lse", (batch, kv_heads, splits, group))
            op.expect_dtype("part_o", DType.F32)
            op.expect_dtype("part_lse", DType.F32)
        for name in ("q", "k_cache", "v_cache"):
            op.expect_dtype(name, DType.BF16)
        op.expect_same_split("q", 1, "k_cache", 2)
        op.expect_same_split("q", 0, "positions", 0)
        op.expect_same_split("q", 0, "page_table", 0)
        if op.axis_of("q", 1) not in (0, None) or op.axis_of("q", 0) not in (1, None):
            raise op.error("grid axis 0 splits KV heads, axis 1 splits the batch")

    def param_values(self, op: OpView) -> dict[str, int | float]:
        num_pages, page_size, kv_heads, head_dim = op.shape("k_cache")
        scale = op.attrs["scale"] or head_dim ** -0.5
        return {"batch": op.shape("q")[0], "group": op.shape("q")[2] // head_dim,
                "head_dim": head_dim, "kv_heads": kv_heads, "page_size": page_size,
                "max_pages": op.shape("page_table")[1], "num_splits": op.grid[2],
                "heads_per_task": op.tile_shape("q")[1], "scale": scale,
                "batch_per_task": op.tile_shape("q")[0], "num_pages": num_pages}

    def reference(self, tile: Tile) -> None:
        p = self.param_values(tile.op)
        d, group = p["head_dim"], p["group"]
        heads = tile["q"].shape[1]
        split = tile.point[2]
        for b in range(tile["q"].shape[0]):
            length = int(tile["positions"][b]) + tile.step + 1
            chunk = math.ceil(length / p["num_splits"])
            lo, hi = split * chunk, min(length, (split + 1) * chunk)
            q = tile["q"][b].float().reshape(heads, group, d)
            o, lse = _partial(q, tile, b, lo, hi, p)
            if p["num_splits"] == 1:
                tile["out"][b].copy_(o.reshape(heads, group * d))
            else:
                tile["part_o"][b, :, 0].copy_(o.reshape(heads, group * d))
                tile["part_lse"][b, :, 0].copy_(lse)

    def cost(self, op: OpView) -> TaskCost:
        # Decode attention cost grows with the context; the scheduler assumes 1k positions.
        _, page_size, heads, d = op.tile_shape("k_cache")
        batch = op.tile_shape("q")[0]
        kv_bytes = batch * 2 * 1024 * heads * d * 2 // op.grid[2]
        return TaskCost(weight_bytes=0, act_bytes=kv_bytes, flops=kv_bytes * 2)


def _partial(q: torch.Tensor, tile: Tile, b: int, lo: int, hi: int,
             p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [heads, G, D] over positions [lo, hi) of row b: (o, lse)."""
    heads, group, d = q.shape
    if hi <= lo:
        return torch.zeros_like(q), torch.full((heads, group), -math.inf)
    pos = torch.arange(lo, hi)
    pages = tile["page_table"][b, pos // p["page_size"]].long()
    slots = pos % p["page_size"]
    k = tile["k_cache"][pages, slots].float()  # [n, heads, D]
    v = tile["v_cache"][pages, slots].float()
    scores = torch.einsum("hgd,nhd->hgn", q, k) * p["scale"]
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.einsum("hgn,nhd->hgd", torch.exp(scores - lse[..., None]), v)
    return o, lse
