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

Several sequences (segments) may share a chunk: positions, chunk [S] i32, page_table [S,
max_pages] and starts [S] i32 (segment s holds rows starts[s] .. starts[s] + chunk[s] - 1 at
positions positions[s] ..., through page-table row s; the host keeps segments apart). Without
starts there is one segment at row 0. The CUDA kernels take one segment (cuda_unsupported).
"""

from __future__ import annotations

import torch

from mpk.dtypes import DType
from mpk.tasks.attention.task import MAX_HEAD_DIM, rope_rotate
from mpk.tasks.base import TASK_WARPS, Access, OperandSpec, OpView, Param, TaskCost, TaskKind, Tile
from mpk.tasks.numerics import bf16, rmsnorm_rows
from mpk.tasks.registry import register
from mpk.tensors import Role

ROW_VECS = 6  # a row's vectors a lane group loads at once (sm90.cuh kRowVecs: ROPE_ROW_VECS)


def page_slots(table: torch.Tensor, positions: torch.Tensor, page_size: int, num_pages: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pages, slots, valid) of positions through a page-table row [max_pages] (or one row per
    position, [n, max_pages]): valid is False where the entry is outside the table or the pool
    (the position is then neither written nor attended; its page and slot are 0)."""
    rows = table.expand(len(positions), -1) if table.dim() == 1 else table
    index = positions // page_size
    inside = index < rows.shape[1]
    pages = rows.gather(1, index.clamp(max=rows.shape[1] - 1)[:, None].long())[:, 0].long()
    valid = inside & (pages >= 0) & (pages < num_pages)
    return torch.where(valid, pages, 0), torch.where(valid, positions % page_size, 0), valid


def segment_rows(tile: Tile, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor]:
    """(segment, position, live) of chunk rows: the segment whose rows hold the row, the row's
    position in it; live is False for padding (in no segment's prompt rows inside the rope
    table)."""
    p0, n = tile["positions"].long(), tile["chunk"].long()
    starts = tile["starts"].long() if tile.has("starts") else torch.zeros_like(p0)
    max_pos = tile["rope"].shape[0]
    prompt = torch.where(p0 >= 0, (torch.minimum(n, max_pos - p0)).clamp(min=0), 0)
    inside = (rows[:, None] >= starts[None, :]) & (rows[:, None] < (starts + prompt)[None, :])
    seg = inside.int().argmax(dim=1)  # the first segment holding the row
    return seg, p0[seg] + rows - starts[seg], inside.any(dim=1)


def check_sequence(op: OpView, rows: int) -> tuple[int, int]:
    """The checks rope_append and attention_prefill share: one sequence's positions, chunk,
    page table, RoPE table and KV caches, and the grid (KV heads, row blocks dividing the C
    rows). Returns (KV heads, head_dim)."""
    _, _, kv_heads, d = op.shape("k_cache")
    op.expect_shape("v_cache", op.shape("k_cache"))
    check_segments(op)
    op.expect_shape("rope", (op.shape("rope")[0], d))
    for name in ("k_cache", "v_cache"):
        op.expect_dtype(name, DType.BF16)
    op.expect_dtype("rope", DType.F32)
    if d % 16 or not 16 <= d <= MAX_HEAD_DIM:
        raise op.error(f"head_dim {d} is not supported: use a multiple of 16 up to "
                       f"{MAX_HEAD_DIM}")
    if op.grid[0] != kv_heads or op.grid[2] != 1 or rows % op.grid[1]:
        raise op.error(f"the grid is (KV heads, row blocks dividing {rows}) = "
                       f"({kv_heads}, RB), got {op.grid}")
    return kv_heads, d


def check_segments(op: OpView) -> int:
    """positions, chunk [S], page_table [S, max_pages] (when the op has it) and starts [S]
    (required when S > 1), all i32. Returns S."""
    segments = op.shape("positions")[0] if len(op.shape("positions")) == 1 else 0
    if segments < 1:
        raise op.error(f"positions must be [S], got {op.shape('positions')}")
    op.expect_shape("chunk", (segments,))
    names = ["positions", "chunk"]
    if op.has("page_table"):
        if len(op.shape("page_table")) != 2 or op.shape("page_table")[0] != segments:
            raise op.error(f"page_table must be [{segments}, max_pages], got "
                           f"{op.shape('page_table')}")
        names.append("page_table")
    if op.has("starts"):
        op.expect_shape("starts", (segments,))
        names.append("starts")
    elif segments > 1:
        raise op.error(f"{segments} segments need 'starts' (each segment's first row)")
    for name in names:
        op.expect_dtype(name, DType.I32)
    return segments


def cuda_one_segment(op: OpView) -> str | None:
    """The prefill kinds' CUDA kernels read segment 0 only."""
    if op.shape("positions")[0] > 1:
        return "the CUDA prefill kernels take one sequence a chunk (no 'starts' segments yet)"
    return None


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
        OperandSpec("starts", Access.READ, optional=True),
    )
    params = (Param("group"), Param("head_dim"), Param("kv_heads"), Param("page_size"),
              Param("max_pages"), Param("num_pages"), Param("max_pos"), Param("block"),
              Param("has_qk_norm"), Param("eps", is_float=True))
    # Each task appends only its own rows' positions (distinct positions of one sequence).
    disjoint_writes = ("k_cache", "v_cache")
    attrs = {"eps": 1e-6}

    cuda_defaults = {"ROPE_ROW_VECS": ROW_VECS}

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

    def cuda_unsupported(self, op: OpView) -> str | None:
        if op.tensors["rope"].role is not Role.WEIGHT:
            return ("its RoPE table must be a weight tensor: the kernel reads it through L1, "
                    "which a write during the launch would leave stale")
        return cuda_one_segment(op)

    def reference(self, tile: Tile) -> None:
        num_pages, page_size, _, d = tile["k_cache"].shape
        block = tile["qkv"].shape[0]
        group = tile["q"].shape[1] // d
        r0 = tile.point[1] * block
        seg, pos, live = segment_rows(tile, torch.arange(r0, r0 + block))
        tile["q"].zero_()
        rows = live.nonzero()[:, 0]  # this task's prompt rows (tile rows)
        if len(rows) == 0:
            return
        seg, pos = seg[rows], pos[rows]
        vecs = tile["qkv"][rows].float().reshape(len(rows), group + 2, d)
        q, k, v = vecs[:, :group], vecs[:, group], vecs[:, group + 1]
        if tile.has("q_norm"):
            q = rmsnorm_rows(q, tile["q_norm"], tile.attr("eps"))
            k = rmsnorm_rows(k, tile["k_norm"], tile.attr("eps"))
        cos, sin = tile["rope"][pos, : d // 2], tile["rope"][pos, d // 2:]
        tile["q"][rows] = bf16(rope_rotate(q, cos[:, None], sin[:, None])).reshape(
            len(rows), -1).to(tile["q"].dtype)
        k = bf16(rope_rotate(k, cos, sin))
        pages, slots, valid = page_slots(tile["page_table"][seg], pos, page_size, num_pages)
        tile["k_cache"][pages[valid], slots[valid], 0] = k[valid].to(tile["k_cache"].dtype)
        tile["v_cache"][pages[valid], slots[valid], 0] = v[valid].to(tile["v_cache"].dtype)

    def cost(self, op: OpView) -> TaskCost:
        rows, width = op.shape("qkv")
        block = rows // op.grid[1]
        per_row = width // op.grid[0] * 2  # one head's G + 2 vectors of a row, bf16
        return TaskCost(weight_bytes=0, act_bytes=2 * block * per_row, flops=8 * block * per_row,
                        round_trips=self.round_trips(op, block))

    def round_trips(self, op: OpView, block: int) -> int:
        """sm90.cuh's loads one after another: the positions, then the page entries and norm
        weights, then a lane group's rows, one round of ROW_VECS vectors at a time. The
        scheduler needs them: counted by bytes alone, a task looked like 6 us where it took 34,
        and list scheduling stacked 14-15 of a layer's tasks on each of the 12 SMs that had a
        qkv tile fewer (perf-log, thirty-fifth session)."""
        p = self.param_values(op)
        lanes = -(-int(p["head_dim"]) // 8)
        groups = TASK_WARPS * max(1, 32 // lanes)
        rounds = -(-(int(p["group"]) + 2) // ROW_VECS)
        return 2 + -(-block // groups) * rounds
