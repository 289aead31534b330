"""attention_prefill: causal GQA attention of a prefill chunk, one KV head and block of query
rows per task, over keys and values that are all in the cache: `rope_append` prepared the
chunk's queries and appended its keys and values before it.

q [C, KVH*G*D] bf16 (rope_append's prepared queries: head h's query g of row i at column
(h*G + g)*D), positions [1] i32 (the chunk's first position p0), chunk [1] i32 (n: rows
0 .. n-1 are prompt positions p0 .. p0+n-1; the rest of the C rows are padding), page_table
[1, max_pages] i32 (the sequence's pages), k_cache / v_cache [num_pages, page_size, KVH, D]
bf16 (read), rope [max_pos, D] (only its length is used: rows past it are padding), out
[C, KVH*G*D] bf16.
Row i < n (position p = p0 + i) of KV head h attends to positions [0, p] of the sequence; as in
`attention`, a position whose page entry is outside the page table or the pool is masked out,
and a row that sees no position writes zeros. Padding rows write zeros.
Grid (KVH, QB): task (h, j) takes two pieces of C/(2*QB) rows, pieces j and 2*QB-1-j (row_pieces;
2*QB divides C), or all C rows when QB is 1. A row attends to as many positions as its place
in the chunk, so a block of rows from the start and one from the end give every task the same
work: with blocks side by side, the last task had the most (qwen3-8b's second 1,024-row chunk of
a 2,048-token prompt: 64 passes over a block of 64 keys in the last task, 49 on average).
The tasks' `q` and `out` boxes span from the first piece to the second (disjoint_writes: each
task writes only its pieces' rows).
Segments (several sequences in one chunk: starts, as for rope_append): a row attends to the
positions of its own segment's sequence, through that segment's page-table row.

CUDA (sm90.cuh): flash attention on tensor cores, head dims up to CUDA_MAX_HEAD_DIM.
"""

from __future__ import annotations

import math

import torch

from mpk.dtypes import DType
from mpk.tasks.base import (Access, Box, OpView, OperandSpec, Param, TaskCost, TaskKind,
                             Tile)
from mpk.tasks.registry import register
from mpk.tasks.rope_append.task import (check_sequence, cuda_one_segment, page_slots,
                                         segment_rows, sequence_params)

CUDA_MAX_HEAD_DIM = 128  # sm90.cuh holds a 16-row x D output tile per warp in registers


def staged_head_dim(d: int) -> int:
    """The width sm90.cuh stages a head's rows at (PREFILL_HEAD_DIM): 64 or 128, zeros past d."""
    return 64 if d <= 64 else CUDA_MAX_HEAD_DIM


def row_pieces(rows: int, blocks: int, j: int) -> tuple[tuple[int, int], ...]:
    """Task j's rows [lo, hi) of a chunk of `rows` rows in `blocks` row blocks: pieces j and
    2*blocks-1-j of rows/(2*blocks) rows, in that order (all rows when blocks is 1)."""
    if blocks == 1:
        return ((0, rows),)
    size = rows // (2 * blocks)
    return ((j * size, (j + 1) * size), (rows - (j + 1) * size, rows - j * size))


@register
class AttentionPrefill(TaskKind):
    name = "attention_prefill"
    operands = (
        OperandSpec("q", Access.READ),
        OperandSpec("rope", Access.READ),
        OperandSpec("positions", Access.READ),
        OperandSpec("chunk", Access.READ),
        OperandSpec("page_table", Access.READ),
        OperandSpec("k_cache", Access.READ),
        OperandSpec("v_cache", Access.READ),
        OperandSpec("out", Access.WRITE),
        OperandSpec("starts", Access.READ, optional=True),
    )
    params = (Param("group"), Param("head_dim"), Param("kv_heads"), Param("page_size"),
              Param("max_pages"), Param("num_pages"), Param("max_pos"), Param("block"),
              Param("scale", is_float=True), Param("chunk_rows"))
    attrs = {"scale": 0.0}  # scale 0 means head_dim ** -0.5
    disjoint_writes = ("out",)  # a task writes its two pieces, not the rows between them
    cuda_defaults = {"PREFILL_HEAD_DIM": 64}

    def default_splits(self, grid, tensors):
        return {"q": (1, 0, None), "k_cache": (2, None, None), "v_cache": (2, None, None),
                "out": (1, 0, None)}

    def check(self, op: OpView) -> None:
        rows, width = op.shape("q")
        kv_heads, d = check_sequence(op, rows)
        if width % (kv_heads * d):
            raise op.error(f"q {op.shape('q')} must be [C, {kv_heads}*G*{d}]")
        op.expect_shape("out", (rows, width))
        for name in ("q", "out"):
            op.expect_dtype(name, DType.BF16)
        op.expect_same_split("q", 1, "k_cache", 2)
        op.expect_same_split("out", 1, "k_cache", 2)
        if op.grid[1] > 1 and rows % (2 * op.grid[1]):
            raise op.error(f"{op.grid[1]} row blocks take two pieces each: 2 * {op.grid[1]} "
                           f"must divide the {rows} rows")

    def param_values(self, op: OpView) -> dict[str, int | float]:
        rows, width = op.shape("q")
        p = sequence_params(op, rows)
        (lo, hi), *_ = row_pieces(rows, op.grid[1], 0)
        return {**p, "group": width // (p["kv_heads"] * p["head_dim"]), "block": hi - lo,
                "scale": op.attrs["scale"] or p["head_dim"] ** -0.5, "chunk_rows": rows}

    def region(self, op: OpView, operand: str, point: tuple[int, int, int]) -> Box:
        box = super().region(op, operand, point)
        if operand not in ("q", "out"):
            return box
        pieces = row_pieces(op.shape("q")[0], op.grid[1], point[1])
        return ((pieces[0][0], pieces[-1][1]),) + box[1:]

    def cuda_constants(self, op: OpView, flagged: frozenset[str] = frozenset()
                       ) -> dict[str, int]:
        return {"PREFILL_HEAD_DIM": staged_head_dim(op.shape("k_cache")[3])}

    def scratch_bytes(self, op: OpView) -> int:
        # sm90.cuh: queries [128][W + 8] bf16, two buffers of keys and values [64][W + 8] bf16
        # (W: the plan's PREFILL_HEAD_DIM, the largest staged_head_dim of its ops) and their
        # flags [64] i32, the task's context (under 256 bytes), the page table.
        width = staged_head_dim(op.shape("k_cache")[3])
        return (2 * (128 + 4 * 64) * (width + 8) + 2 * 64 * 4 + 256
                + 4 * op.shape("page_table")[1])

    def cuda_unsupported(self, op: OpView) -> str | None:
        return cuda_one_segment(op)

    def reference(self, tile: Tile) -> None:
        num_pages, page_size, _, d = tile["k_cache"].shape
        group = tile["q"].shape[1] // d
        pieces = row_pieces(tile.op.shape("q")[0], tile.op.grid[1], tile.point[1])
        rows = torch.cat([torch.arange(lo, hi) for lo, hi in pieces])
        local = rows - pieces[0][0]  # the rows in the task's box
        seg, pos, live = segment_rows(tile, rows)
        tile["out"][local] = 0
        scale = tile.attr("scale") or d ** -0.5
        for s in seg[live].unique().tolist():  # the segments of this task's prompt rows
            sel = live & (seg == s)
            tile["out"][local[sel]] = self._attend(tile, s, tile["q"][local[sel]], pos[sel],
                                                   group, scale).to(tile["out"].dtype)

    @staticmethod
    def _attend(tile: Tile, s: int, q: torch.Tensor, pos: torch.Tensor, group: int,
                scale: float) -> torch.Tensor:
        """Rows q [n, G*D] at positions pos of segment s over positions [0, pos] of its
        sequence: [n, G*D] fp32."""
        num_pages, page_size, _, d = tile["k_cache"].shape
        keys_at = torch.arange(int(pos.max()) + 1)
        pages, slots, valid = page_slots(tile["page_table"][s], keys_at, page_size, num_pages)
        keys = tile["k_cache"][pages, slots, 0].float()  # [L, D]
        values = tile["v_cache"][pages, slots, 0].float()
        scores = torch.einsum("igd,ld->igl", q.float().reshape(len(pos), group, d), keys) * scale
        visible = (keys_at[None, :] <= pos[:, None]) & valid[None, :]
        scores = scores.masked_fill(~visible[:, None, :], -math.inf)
        # attention's arithmetic: exp(s - logsumexp) against fp32 values; a row that sees no
        # position (every page entry invalid) gets zeros
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        o = torch.einsum("igl,ld->igd", torch.exp(scores - lse), values)
        o = torch.where(torch.isfinite(lse), o, torch.zeros_like(o))
        return o.reshape(len(pos), group * d)

    def cost(self, op: OpView) -> TaskCost:
        # The chunk's keys and values of one head, against a block of queries of its G heads
        # (the cached context is not known at compile time).
        rows, width = op.shape("q")
        _, _, heads, d = op.shape("k_cache")
        group = width // (heads * d)
        block = rows // op.grid[1]
        return TaskCost(weight_bytes=0, act_bytes=2 * 2 * rows * d * 2,
                        flops=4 * block * group * rows * d)
