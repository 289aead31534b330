"""rope_append: the query and key preparation of a prefill chunk and its KV append, one KV head
and block of rows per task, ahead of `attention_prefill` (which then reads every key and value
it attends to from the cache).

qkv [C, KVH*(G+2)*D] bf16 (grouped per KV head as for `attention`: G queries, the key, the
value), q_norm / k_norm [D] (optional, Qwen3), rope [max_pos, D] f32, positions [1] i32 (the
chunk's first position p0), chunk [1] i32 (n: rows 0 .. n-1 are prompt positions p0 .. p0+n-1,
the rest padding), page_table [1, max_pages] i32, k_cache / v_cache [num_pages, page_size, KVH,
D] bf16 (written), q [C, KVH*G*D] bf16 (written: head h's query g of row i at column (h*G + g)*D).
Row i < n (position p = p0 + i), KV head h:
  q, k = RoPE(RMSNorm(q), RMSNorm(k)) at p (fp32, rounded to bf16 once: `attention`'s
  preparation and rounding); q goes to q, k and v (as is) to the cache at p when its page entry
  is inside the page table and the pool (otherwise nowhere).
Padding rows (i >= n, or positions outside [0, max_pos)) write zero queries and nothing to the
caches. Grid (KVH, RB): task (h, j) takes rows [j*C/RB, (j+1)*C/RB) (RB divides C).
"""

from __future__ import annotations

import torch

from mpk.dtypes import DType
from mpk.tasks.attention.task import MAX_HEAD_DIM, rope_rotate
from mpk.tasks.base import Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.numerics import bf16, rmsnorm_rows
from mpk.tasks.registry import register


def prompt_rows(chunk: int, p0: int, max_pos: int) -> int:
    """How many of a chunk's rows are prompt positions inside the rope table."""
    return max(0, min(chunk, max_pos - p0)) if p0 >= 0 else 0


def page_slots(table: torch.Tensor, positions: torch.Tensor, page_size: int, num_pages: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pages, slots, valid) of positions through a page-table row: valid is False where the
    entry is outside the table or the pool (the position is then neither written nor attended;
    its page and slot are 0)."""
    index = positions // page_size
    inside = index < table.shape[0]
    pages = table[index.clamp(max=table.shape[0] - 1)].long()
    valid = inside & (pages >= 0) & (pages < num_pages)
    return torch.where(valid, pages, 0), torch.where(valid, positions % page_size, 0), valid


def check_sequence(op: OpView, rows: int) -> tuple[int, int]:
    """The checks rope_append and attention_prefill share: one sequence's positions, chunk,
    page table, RoPE table and KV caches, and the grid (KV heads, row blocks dividing the C
    rows). Returns (KV heads, head_dim)."""
    _, _, kv_heads, d = op.shape("k_cache")
    op.expect_shape("v_cache", op.shape("k_cache"))
    op.expect_shape("positions", (1,))
    op.expect_shape("chunk", (1,))
    op.expect_shape("rope", (op.shape("rope")[0], d))
    if len(op.shape("page_table")) != 2 or op.shape("page_table")[0] != 1:
        raise op.error(f"page_table must be [1, max_pages], got {op.shape('page_table')}")
    for name in ("k_cache", "v_cache"):
        op.expect_dtype(name, DType.BF16)
    for name in ("positions", "chunk", "page_table"):
        op.expect_dtype(name, DType.I32)
    op.expect_dtype("rope", DType.F32)
    if d % 16 or not 16 <= d <= MAX_HEAD_DIM:
        raise op.error(f"head_dim {d} is not supported: use a multiple of 16 up to "
                       f"{MAX_HEAD_DIM}")
    if op.grid[0] != kv_heads or op.grid[2] != 1 or rows % op.grid[1]:
        raise op.error(f"the grid is (KV heads, row blocks dividing {rows}) = "
                       f"({kv_heads}, RB), got {op.grid}")
    return kv_heads, d


def sequence_params(op: OpView, rows: int) -> dict[str, int]:
    """The param values rope_append and attention_prefill share."""
    num_pages, page_size, kv_heads, d = op.shape("k_cache")
    return {"head_dim": d, "kv_heads": kv_heads, "page_size": page_size,
            "max_pages": op.shape("page_table")[1], "num_pages": num_pages,
            "max_pos": op.shape("rope")[0], "block": rows // op.grid[1]}


@register
class RopeAppend(TaskKind):
    name = "rope_append"
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
        OperandSpec("q", Access.WRITE),
    )
    params = (Param("group"), Param("head_dim"), Param("kv_heads"), Param("page_size"),
              Param("max_pages"), Param("num_pages"), Param("max_pos"), Param("block"),
              Param("has_qk_norm"), Param("eps", is_float=True))
    # Each task appends only its own rows' positions (distinct positions of one sequence).
    disjoint_writes = ("k_cache", "v_cache")
    attrs = {"eps": 1e-6}

    def default_splits(self, grid, tensors):
        return {"qkv": (1, 0, None), "k_cache": (2, None, None), "v_cache": (2, None, None),
                "q": (1, 0, None)}

    def check(self, op: OpView) -> None:
        rows, width = op.shape("qkv")
        kv_heads, d = check_sequence(op, rows)
        if width % (kv_heads * d) or width // (kv_heads * d) < 3:
            raise op.error(f"qkv {op.shape('qkv')} must be [C, {kv_heads}*(G+2)*{d}]")
        group = width // (kv_heads * d) - 2
        op.expect_shape("q", (rows, kv_heads * group * d))
        if op.has("q_norm") != op.has("k_norm"):
            raise op.error("give both q_norm and k_norm or neither")
        for name in ("qkv", "q", *(n for n in ("q_norm", "k_norm") if op.has(n))):
            op.expect_dtype(name, DType.BF16)
        for name in ("q_norm", "k_norm"):
            if op.has(name):
                op.expect_shape(name, (d,))
        op.expect_same_split("qkv", 1, "k_cache", 2)
        op.expect_same_split("q", 1, "k_cache", 2)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        rows, width = op.shape("qkv")
        p = sequence_params(op, rows)
        return {**p, "group": width // (p["kv_heads"] * p["head_dim"]) - 2,
                "has_qk_norm": int(op.has("q_norm")), "eps": op.attrs["eps"]}

    def scratch_bytes(self, op: OpView) -> int:
        # sm90.cuh: the norm weights (f32), the page entries of a block's positions (i32)
        block = op.shape("qkv")[0] // op.grid[1]
        return 2 * op.shape("k_cache")[3] * 4 + 4 * (block + 2)

    def reference(self, tile: Tile) -> None:
        num_pages, page_size, _, d = tile["k_cache"].shape
        block = tile["qkv"].shape[0]
        group = tile["q"].shape[1] // d
        r0 = tile.point[1] * block
        p0 = int(tile["positions"][0])
        n = prompt_rows(int(tile["chunk"][0]), p0, tile["rope"].shape[0])
        tile["q"].zero_()
        hi = max(0, min(block, n - r0))  # this task's prompt rows: tile rows 0 .. hi-1
        if hi == 0:
            return
        vecs = tile["qkv"][:hi].float().reshape(hi, group + 2, d)
        q, k, v = vecs[:, :group], vecs[:, group], vecs[:, group + 1]
        if tile.has("q_norm"):
            q = rmsnorm_rows(q, tile["q_norm"], tile.attr("eps"))
            k = rmsnorm_rows(k, tile["k_norm"], tile.attr("eps"))
        pos = torch.arange(p0 + r0, p0 + r0 + hi)
        cos, sin = tile["rope"][pos, : d // 2], tile["rope"][pos, d // 2:]
        tile["q"][:hi].copy_(bf16(rope_rotate(q, cos[:, None], sin[:, None])).reshape(hi, -1))
        k = bf16(rope_rotate(k, cos, sin))
        pages, slots, valid = page_slots(tile["page_table"][0], pos, page_size, num_pages)
        tile["k_cache"][pages[valid], slots[valid], 0] = k[valid].to(tile["k_cache"].dtype)
        tile["v_cache"][pages[valid], slots[valid], 0] = v[valid].to(tile["v_cache"].dtype)

    def cost(self, op: OpView) -> TaskCost:
        rows, width = op.shape("qkv")
        block = rows // op.grid[1]
        per_row = width // op.grid[0] * 2  # one head's G + 2 vectors of a row, bf16
        return TaskCost(weight_bytes=0, act_bytes=2 * block * per_row, flops=8 * block * per_row)
