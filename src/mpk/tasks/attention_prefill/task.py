"""attention_prefill: causal GQA attention of a prefill chunk, one KV head and block of query
rows per task, with the query/key preparation and the KV append fused in.

qkv [C, KVH*(G+2)*D] bf16 (grouped per KV head as for `attention`: G queries, the key, the
value), q_norm / k_norm [D] (optional, Qwen3), rope [max_pos, D] f32, positions [1] i32 (the
chunk's first position p0), chunk [1] i32 (n: rows 0 .. n-1 are prompt positions p0 .. p0+n-1;
the rest of the C rows are padding), page_table [1, max_pages] i32 (the sequence's pages),
k_cache / v_cache [num_pages, page_size, KVH, D] bf16 (read and written), out [C, KVH*G*D] bf16.
Row i < n (position p = p0 + i) of KV head h:
  1. q, k = RoPE(RMSNorm(q), RMSNorm(k)) at p (fp32, rounded to bf16 once), v as is: the same
     preparation, rounding and cache write as `attention`.
  2. attends to the cached positions [0, p0) of the sequence and to chunk rows 0 .. i, whose
     keys and values it prepares from qkv itself (other tasks of the op write them to the
     cache, unordered with this one); as in `attention`, a position whose page entry is outside
     the page table or the pool is masked out, and a row that sees no position writes zeros.
  3. the task of rows [r0, r1) writes the keys and values of its rows below n to the cache.
Padding rows (i >= n), and rows whose position is outside [0, max_pos), write zeros to out and
nothing to the caches.
Grid (KVH, QB): task (h, j) takes rows [j*C/QB, (j+1)*C/QB) (QB divides C).

CUDA (sm90.cuh): flash attention on tensor cores, head dims up to CUDA_MAX_HEAD_DIM.
"""

from __future__ import annotations

import math

import torch

from mpk.dtypes import DType
from mpk.tasks.attention.task import MAX_HEAD_DIM, rope_rotate
from mpk.tasks.base import Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.numerics import bf16, rmsnorm_rows
from mpk.tasks.registry import register

CUDA_MAX_HEAD_DIM = 128  # sm90.cuh holds a 16-row x D output tile per warp in registers


@register
class AttentionPrefill(TaskKind):
    name = "attention_prefill"
    operands = (
        OperandSpec("qkv", Access.READ),
        OperandSpec("q_norm", Access.READ, optional=True, weight=True),
        OperandSpec("k_norm", Access.READ, optional=True, weight=True),
        OperandSpec("rope", Access.READ),
        OperandSpec("positions", Access.READ),
        OperandSpec("chunk", Access.READ),
        OperandSpec("page_table", Access.READ),
        OperandSpec("k_cache", Access.READ_WRITE),
        OperandSpec("v_cache", Access.READ_WRITE),
        OperandSpec("out", Access.WRITE),
    )
    params = (Param("rows"), Param("group"), Param("head_dim"), Param("kv_heads"),
              Param("page_size"), Param("max_pages"), Param("num_pages"), Param("max_pos"),
              Param("block"), Param("has_qk_norm"), Param("scale", is_float=True),
              Param("eps", is_float=True))
    # Each task appends only its own rows' positions; other tasks' positions it prepares itself.
    disjoint_writes = ("k_cache", "v_cache")
    attrs = {"scale": 0.0, "eps": 1e-6}  # scale 0 means head_dim ** -0.5

    def default_splits(self, grid, tensors):
        return {"qkv": (1, None, None), "k_cache": (2, None, None),
                "v_cache": (2, None, None), "out": (1, 0, None)}

    def check(self, op: OpView) -> None:
        num_pages, page_size, kv_heads, d = op.shape("k_cache")
        op.expect_shape("v_cache", op.shape("k_cache"))
        rows, width = op.shape("qkv")
        if width % (kv_heads * d) or width // (kv_heads * d) < 3:
            raise op.error(f"qkv {op.shape('qkv')} must be [C, {kv_heads}*(G+2)*{d}]")
        group = width // (kv_heads * d) - 2
        op.expect_shape("out", (rows, kv_heads * group * d))
        op.expect_shape("positions", (1,))
        op.expect_shape("chunk", (1,))
        op.expect_shape("rope", (op.shape("rope")[0], d))
        if len(op.shape("page_table")) != 2 or op.shape("page_table")[0] != 1:
            raise op.error(f"page_table must be [1, max_pages], got {op.shape('page_table')}")
        if op.has("q_norm") != op.has("k_norm"):
            raise op.error("give both q_norm and k_norm or neither")
        for name in ("qkv", "k_cache", "v_cache", "out", *(n for n in ("q_norm", "k_norm")
                                                             if op.has(n))):
            op.expect_dtype(name, DType.BF16)
        for name in ("positions", "chunk", "page_table"):
            op.expect_dtype(name, DType.I32)
        op.expect_dtype("rope", DType.F32)
        if d % 16 or not 16 <= d <= MAX_HEAD_DIM:
            raise op.error(f"head_dim {d} is not supported: use a multiple of 16 up to "
                           f"{MAX_HEAD_DIM}")
        for name in ("q_norm", "k_norm"):
            if op.has(name):
                op.expect_shape(name, (d,))
        if op.grid[0] != kv_heads or op.grid[2] != 1 or rows % op.grid[1]:
            raise op.error(f"the grid is (KV heads, query blocks dividing {rows}) = "
                           f"({kv_heads}, QB), got {op.grid}")
        op.expect_unsplit("qkv", 0)
        op.expect_same_split("qkv", 1, "k_cache", 2)
        op.expect_same_split("out", 1, "k_cache", 2)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        num_pages, page_size, kv_heads, d = op.shape("k_cache")
        rows, width = op.shape("qkv")
        return {"rows": rows, "group": width // (kv_heads * d) - 2, "head_dim": d,
                "kv_heads": kv_heads, "page_size": page_size,
                "max_pages": op.shape("page_table")[1], "num_pages": num_pages,
                "max_pos": op.shape("rope")[0], "block": rows // op.grid[1],
                "has_qk_norm": int(op.has("q_norm")), "scale": op.attrs["scale"] or d ** -0.5,
                "eps": op.attrs["eps"]}

    def scratch_bytes(self, op: OpView) -> int:
        # sm90.cuh: prepared queries [128][D + 8], keys and values [64][D + 8] (bf16), key
        # flags [64] i32, the task's context (under 256 bytes).
        d = op.shape("k_cache")[3]
        return 2 * (128 + 2 * 64) * (d + 8) + 64 * 4 + 256

    def reference(self, tile: Tile) -> None:
        num_pages, page_size, heads, d = tile["k_cache"].shape
        rows, width = tile["qkv"].shape
        group = width // d - 2
        block = rows // tile.op.grid[1]
        r0 = tile.point[1] * block
        n, p0 = int(tile["chunk"][0]), int(tile["positions"][0])
        n = min(n, tile["rope"].shape[0] - p0)  # rows past the rope table are padding
        hi = max(r0, min(r0 + block, n))  # this task's real rows are [r0, hi)
        tile["out"].zero_()
        if hi == r0 or p0 < 0:
            return
        scale = tile.attr("scale") or d ** -0.5
        pos = torch.arange(p0, p0 + hi)
        q, k, v = self._vectors(tile, hi, pos, group, d)
        self._append(tile, r0, hi, pos, k, v, page_size, num_pages)
        ck, cv = self._cached(tile, p0, page_size, num_pages)  # [L, heads, D]
        keys = torch.cat([ck, k])  # cached positions, then chunk rows 0 .. hi-1
        values = torch.cat([cv, v])
        scores = torch.einsum("ihgd,lhd->ihgl", q[r0:hi], keys) * scale
        visible = torch.arange(len(ck) + hi)[None, :] <= (len(ck) + torch.arange(r0, hi))[:, None]
        visible[:, len(ck):] &= self._paged(tile, pos, page_size, num_pages)[None, :]
        scores = scores.masked_fill(~visible[:, None, None, :], -math.inf)
        # attention's arithmetic: exp(s - logsumexp) against fp32 values; a row that sees no
        # position (every page entry invalid) gets zeros
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        o = torch.einsum("ihgl,lhd->ihgd", torch.exp(scores - lse), values)
        o = torch.where(torch.isfinite(lse), o, torch.zeros_like(o))
        tile["out"][: hi - r0].copy_(o.reshape(hi - r0, heads * group * d))  # the block's rows

    def _vectors(self, tile: Tile, hi: int, pos: torch.Tensor, group: int, d: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [hi, heads, G, D] (bf16 values), k, v [hi, heads, D] of rows 0 .. hi-1."""
        vecs = tile["qkv"][:hi].float().reshape(hi, -1, group + 2, d)
        q, k, v = vecs[:, :, :group], vecs[:, :, group], vecs[:, :, group + 1]
        if tile.has("q_norm"):
            q = rmsnorm_rows(q, tile["q_norm"], tile.attr("eps"))
            k = rmsnorm_rows(k, tile["k_norm"], tile.attr("eps"))
        cos, sin = tile["rope"][pos, : d // 2], tile["rope"][pos, d // 2:]
        q = bf16(rope_rotate(q, cos[:, None, None], sin[:, None, None]))
        k = bf16(rope_rotate(k, cos[:, None], sin[:, None]))
        return q, k, v

    @staticmethod
    def _paged(tile: Tile, pos: torch.Tensor, page_size: int, num_pages: int) -> torch.Tensor:
        """Whether each chunk position's page entry is inside the page table and the pool."""
        table = tile["page_table"][0]
        index = pos // page_size
        inside = index < table.shape[0]
        pages = table[index.clamp(max=table.shape[0] - 1)].long()
        return inside & (pages >= 0) & (pages < num_pages)

    def _append(self, tile: Tile, r0: int, hi: int, pos: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, page_size: int, num_pages: int) -> None:
        table = tile["page_table"][0]
        for i in range(r0, hi):
            p = int(pos[i])
            if p // page_size >= table.shape[0]:
                continue
            page = int(table[p // page_size])
            if 0 <= page < num_pages:
                tile["k_cache"][page, p % page_size].copy_(k[i])
                tile["v_cache"][page, p % page_size].copy_(v[i])

    def _cached(self, tile: Tile, p0: int, page_size: int, num_pages: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [L, heads, D] of the cached positions before p0 whose page entry
        is valid, in position order."""
        table = tile["page_table"][0]
        pos = torch.arange(min(p0, table.shape[0] * page_size))
        pages = table[pos // page_size].long()
        pos, pages = pos[(pages >= 0) & (pages < num_pages)], pages[(pages >= 0) &
                                                                    (pages < num_pages)]
        slots = pos % page_size
        return tile["k_cache"][pages, slots].float(), tile["v_cache"][pages, slots].float()

    def cost(self, op: OpView) -> TaskCost:
        # The chunk's keys and values of one head, against a block of queries of its G heads
        # (the cached context is not known at compile time).
        rows, width = op.shape("qkv")
        _, _, heads, d = op.shape("k_cache")
        group = width // (heads * d) - 2
        block = rows // op.grid[1]
        return TaskCost(weight_bytes=0, act_bytes=2 * 2 * rows * d * 2,
                        flops=4 * block * group * rows * d)
