"""attention: one decode step of GQA attention for a tile of KV heads, batch rows and a KV split,
with the query/key preparation fused in front (so a layer has no separate RoPE phase).

qkv [B, KVH*(G+2)*D] bf16: per KV head h its G query heads, its key, then its value (the builder
groups the fused QKV weight this way). q_norm, k_norm [D] bf16 (optional, Qwen3), rope
[max_pos, D] f32 (cos in the first D/2 columns, sin in the last D/2), positions [B] i32 (the
position of step 0), page_table [B, max_pages] i32, k_cache / v_cache [num_pages, page_size,
KVH, D] bf16 (read and written), runs [B, 2] i32 (optional, tasks/runs.py: row b is row i of
a run of width w that shares its pages; absent: every row alone, i = 0, w = 1).
Per row b, p = positions[b] + step * w, L = p + 1:
  1. q, k = RoPE(RMSNorm(q), RMSNorm(k)) (the norm only with q_norm/k_norm; rotate-half RoPE in
     fp32, rounded to bf16 once); v as is. The same for the keys and values of rows b-i .. b-1
     at positions p-i .. p-1 (this step's earlier run rows; those >= 0, and per split those
     inside its range).
  2. the split that covers position p writes k and v there (page page_table[b, p // page_size],
     slot p % page_size); every split reads only its own positions, and positions p-i .. p come
     from step 1, so no task reads a position another task of this step writes.
  3. the row's context is cut into E of the op's S splits (grid axis 2; effective_splits: all S
     when the attr split_positions is 0, else one split up to 2 * split_positions positions and
     ceil(L / split_positions) beyond, at most S: 1, then 3 or more). Split s < E attends to
     positions [s*c, min(L, (s+1)*c)), c = ceil(L/E) (a position whose page entry is outside
     the pool is masked out); splits s >= E attend to nothing and write nothing. With E = 1
     split 0 writes the normalised out [B, KVH*G*D] bf16. With E > 1 (at most MAX_SPLITS),
     split s < E writes fp32 partials part_o[b, h, s] [G*D] and part_lse[b, h, s] [G]
     (natural-log sum-exp, -inf when empty), then every one of the S splits adds one to its
     (row, KV head)'s arrival counter (TaskKind.arrivals); the split whose add makes the
     counter a multiple of S merges the E partials: out = sum_s exp(lse_s - lse) * o_s, lse =
     log(sum_s exp(lse_s)), in split order, so the value does not depend on which split came
     last. (A merge op after the splits was one more dependent phase a layer.) With E = 1 no
     split adds (its counter stays a multiple of S). A short context is one split because the
     merge (a fence, an atomic and a second round trip, ~2.8 us a layer on qwen3-0.6b) costs
     more than splitting a context of up to one round of the CUDA kernel's warps saves
     (perf-log, fortieth session).
A row whose p is outside [0, max_pos) writes nothing to the caches and attends to nothing (E as
for a one-position context).
Grid: (KVH * P, B, S), one KV head of one row per task, or with P > 1 query-head parts (one
split only) P tasks per KV head and row: part j (grid point h * P + j) prepares its G / P query
heads j * G/P .. and the head's key and value, attends over every position and writes its heads'
columns of out; part 0 alone appends to the caches. A head's arithmetic does not depend on the
heads beside it, so P changes no value, only how many SMs share the work (the prepare and the
merge grow with the heads a task holds; the KV loop and the qkv staging do not).
head_dim any multiple of 16 up to 256.
"""

from __future__ import annotations

import math

import torch

from mpk.dtypes import DType
from mpk.tasks.base import Access, Box, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.numerics import bf16, rmsnorm_rows
from mpk.tasks import runs
from mpk.tasks.registry import register

MAX_HEAD_DIM = 256
# Heads up to this build sm90.cuh's smaller register arrays (ATTN_MAX_HEAD_DIM) and stage a
# block's keys in shared memory (kStageKeys); larger ones read the keys from L2.
SMALL_HEAD_DIM = 128
# The flagged output's size, at most (compiler/flags.py allows 32 KB): o_proj polling qwen3-0.6b's
# 32 KB batch-8 output (two rounds while attention's KV walk still runs) cost the step 1.5-1.8%
# against a counted hand-off (H100, three rounds, perf-log thirtieth session), where the same
# size of the hidden stream, written by linears, polled by qkv and gate_up, gained 1.5% at b16.
FLAGGED_OUT_MAX_BYTES = 16 * 1024
# KV splits an op may have: the merging split stages every split's partials in shared memory.
MAX_SPLITS = 16


def effective_splits(length: int, splits: int, split_positions: int) -> int:
    """The splits a row of `length` context positions uses (module doc, 3.): all `splits` when
    split_positions is 0; else 1 up to 2 * split_positions positions, then one per
    split_positions (rounded up), at most `splits`."""
    if split_positions <= 0:
        return splits
    if length <= 2 * split_positions:
        return 1
    return min(splits, -(-length // split_positions))


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the last dim (Hugging Face convention), fp32."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@register
class Attention(TaskKind):
    name = "attention"
    operands = (
        OperandSpec("qkv", Access.READ),
        OperandSpec("q_norm", Access.READ, optional=True, weight=True),
        OperandSpec("k_norm", Access.READ, optional=True, weight=True),
        OperandSpec("rope", Access.READ),
        OperandSpec("positions", Access.READ),
        OperandSpec("page_table", Access.READ),
        OperandSpec("k_cache", Access.READ_WRITE),
        OperandSpec("v_cache", Access.READ_WRITE),
        OperandSpec("out", Access.WRITE),
        # With several splits: read back by the split that merges (each task's box is its
        # (row, KV head)'s every split; a task writes only its own split's part).
        OperandSpec("part_o", Access.READ_WRITE, optional=True),
        OperandSpec("part_lse", Access.READ_WRITE, optional=True),
        OperandSpec("runs", Access.READ, optional=True),
    )
    # Each batch row appends its own position (rows that share pages form a run and hold
    # distinct positions) and a split writes only the position it attends to, so tasks' cache
    # writes never meet at run time although their boxes (all pages of the head) overlap. With
    # several splits, a task writes its own split's partials, and only one writes out (its
    # boxes: the (row, KV head)'s, in every split): split 0 of a row that uses one split, else
    # the merging split.
    disjoint_writes = ("k_cache", "v_cache", "part_o", "part_lse", "out")
    # The CUDA prologue stages the row's position, its page-table slice, the RoPE rows and the
    # norm weights while the task waits for qkv: only the host and the bind write these.
    prologue_operands = ("positions", "runs", "page_table", "rope", "q_norm", "k_norm")
    params = (Param("batch"), Param("group"), Param("head_dim"), Param("kv_heads"),
              Param("page_size"), Param("max_pages"), Param("num_splits"),
              Param("scale", is_float=True), Param("num_pages"), Param("max_pos"),
              Param("has_qk_norm"), Param("eps", is_float=True), Param("parts"),
              Param("split_positions"))
    # scale 0 means head_dim ** -0.5; split_positions 0: every split always (effective_splits)
    attrs = {"scale": 0.0, "eps": 1e-6, "split_positions": 0}
    # sm90.cuh sizes its register arrays for heads up to this: 128, or 256 when a plan needs it
    # ATTN_MERGES: 1 when an op of the plan has several KV splits (else the merge compiles out:
    # its code beside one-split plans' changed their register allocation)
    cuda_defaults = {"ATTN_MAX_HEAD_DIM": SMALL_HEAD_DIM, "ATTN_MERGES": 0}

    def flag_operands(self, op: OpView) -> frozenset[str]:
        # qkv's words of the task's KV head (every row) are polled into the warps' output
        # buffer (8 warps x 8 heads x D f32: B x (G+2) rows of D bf16 must fit) before prepare;
        # out is written in pairs of columns after the last K/V read, in one pass over at most
        # 8 query heads (a second pass would write out before its own reads).
        p = self.param_values(op)
        names = set()
        if p["batch"] * (p["group"] + 2) <= 128:
            names.add("qkv")
        if p["group"] <= 8 and (not op.has("out")
                                or math.prod(op.shape("out")) * 2 <= FLAGGED_OUT_MAX_BYTES):
            names.add("out")
        return frozenset(names)

    def cuda_constants(self, op: OpView, flagged: frozenset[str] = frozenset()
                       ) -> dict[str, int]:
        d = op.shape("k_cache")[3]
        return {"ATTN_MAX_HEAD_DIM": SMALL_HEAD_DIM if d <= SMALL_HEAD_DIM else MAX_HEAD_DIM,
                "ATTN_MERGES": int(op.grid[2] > 1)}

    def default_splits(self, grid, tensors):
        # With query-head parts, grid axis 0 does not cut qkv and the caches into equal tiles
        # (every part of a KV head reads its whole block): region() gives their boxes. It cuts
        # out into equal tiles, one part's heads each.
        whole = _parts(grid, tensors["k_cache"].shape[2]) > 1
        return {"qkv": (None if whole else 1, None, None),
                "k_cache": (None if whole else 2, None, None),
                "v_cache": (None if whole else 2, None, None),
                "page_table": (None, 0, None), "positions": (None, 0, None),
                "runs": (None, 0, None),
                "out": (1, 0, None), "part_o": (None if whole else 1, 0, None),
                "part_lse": (None if whole else 1, 0, None)}  # parts: one split only (check)

    def check(self, op: OpView) -> None:
        num_pages, page_size, kv_heads, head_dim = op.shape("k_cache")
        batch = op.shape("qkv")[0]
        op.expect_shape("v_cache", op.shape("k_cache"))
        width = op.shape("qkv")[1]
        if len(op.shape("qkv")) != 2 or width % (kv_heads * head_dim) or \
                width // (kv_heads * head_dim) < 3:
            raise op.error(f"qkv {op.shape('qkv')} must be [B, {kv_heads}*(G+2)*{head_dim}]")
        group = width // (kv_heads * head_dim) - 2
        if head_dim % 16 or not 16 <= head_dim <= MAX_HEAD_DIM:
            raise op.error(f"head_dim {head_dim} is not supported: use a multiple of 16 up to "
                           f"{MAX_HEAD_DIM}")
        op.expect_shape("positions", (batch,))
        if len(op.shape("page_table")) != 2 or op.shape("page_table")[0] != batch:
            raise op.error(f"page_table must be [{batch}, max_pages], got {op.shape('page_table')}")
        op.expect_shape("rope", (op.shape("rope")[0], head_dim))
        if op.has("q_norm") != op.has("k_norm"):
            raise op.error("give both q_norm and k_norm or neither")
        for name in ("q_norm", "k_norm"):
            if op.has(name):
                op.expect_shape(name, (head_dim,))
                op.expect_dtype(name, DType.BF16)
        for name in ("qkv", "k_cache", "v_cache"):
            op.expect_dtype(name, DType.BF16)
        op.expect_dtype("rope", DType.F32)
        op.expect_dtype("positions", DType.I32)
        op.expect_dtype("page_table", DType.I32)
        if not isinstance(op.attrs["split_positions"], int) or op.attrs["split_positions"] < 0:
            raise op.error(f"split_positions must be a whole number >= 0 (0: every KV split "
                           f"always), got {op.attrs['split_positions']}")
        parts = self._check_grid(op, kv_heads, batch, group)
        self._check_outputs(op, batch, kv_heads, group, head_dim, parts)
        op.expect_same_split("qkv", 1, "k_cache", 2)
        op.expect_unsplit("qkv", 0)  # a run's rows read each other's keys
        op.expect_same_split("page_table", 0, "positions", 0)
        if op.has("runs"):
            op.expect_shape("runs", (batch, runs.WORDS))
            op.expect_dtype("runs", DType.I32)
            op.expect_same_split("runs", 0, "positions", 0)
            op.expect_unsplit("runs", 1)

    def _check_grid(self, op: OpView, kv_heads: int, batch: int, group: int) -> int:
        """The query-head parts P of the grid (KV heads x P, batch rows, KV splits)."""
        parts = _parts(op.grid, kv_heads)
        if op.grid[0] != kv_heads * parts or op.grid[1] != batch or group % parts or \
                (parts > 1 and op.grid[2] > 1):
            raise op.error(f"the grid is (KV heads x P, batch rows, KV splits) = ({kv_heads} x "
                           f"P, {batch}, S) with P dividing the group {group} (P > 1 only with "
                           f"one split): one KV head (or one part of its query heads) of one "
                           f"row per task, got {op.grid}")
        whole = parts > 1  # qkv and the caches: region() (default_splits)
        if op.axis_of("qkv", 1) != (None if whole else 0) or op.axis_of("positions", 0) != 1:
            raise op.error(f"qkv's columns are cut by grid axis 0 (per KV head; whole with "
                           f"query-head parts: region() cuts them) and the rows by axis 1, got "
                           f"{op.splits['qkv']} and {op.splits['positions']}")
        return parts

    def _check_outputs(self, op: OpView, batch: int, kv_heads: int, group: int,
                       head_dim: int, parts: int) -> None:
        splits = op.grid[2]
        op.expect_shape("out", (batch, kv_heads * group * head_dim))
        op.expect_dtype("out", DType.BF16)
        if op.axis_of("out", 1) != 0:
            raise op.error(f"out's columns are cut by grid axis 0, got {op.splits['out']}")
        op.expect_same_split("out", 0, "positions", 0)
        if splits == 1:
            if op.has("part_o") or op.has("part_lse"):
                raise op.error("with one KV split give no partials ('part_o', 'part_lse')")
            return
        if splits > MAX_SPLITS:
            raise op.error(f"{splits} KV splits: at most {MAX_SPLITS} are supported")
        if not (op.has("part_o") and op.has("part_lse")):
            raise op.error("with several KV splits give 'part_o' and 'part_lse' too (the "
                           "splits' partials, which the last split merges into 'out')")
        op.expect_shape("part_o", (batch, kv_heads, splits, group * head_dim))
        op.expect_shape("part_lse", (batch, kv_heads, splits, group))
        for name in ("part_o", "part_lse"):
            op.expect_dtype(name, DType.F32)
            op.expect_unsplit(name, 2, 3)  # the merging split reads every split's part
            op.expect_same_split(name, 0, "positions", 0)
            op.expect_same_split(name, 1, "k_cache", 2)

    def arrivals(self, op: OpView) -> tuple[int, int] | None:
        # One counter a (row, KV head): its S splits arrive, the last merges.
        return (op.grid[0] * op.grid[1], op.grid[2]) if op.grid[2] > 1 else None

    def arrival_group(self, op: OpView, point: tuple[int, int, int]) -> int:
        return point[1] * op.grid[0] + point[0]  # sm90.cuh: row * KV heads + head

    def param_values(self, op: OpView) -> dict[str, int | float]:
        num_pages, page_size, kv_heads, head_dim = op.shape("k_cache")
        scale = op.attrs["scale"] or head_dim ** -0.5
        batch, width = op.shape("qkv")
        return {"batch": batch, "group": width // (kv_heads * head_dim) - 2,
                "head_dim": head_dim, "kv_heads": kv_heads, "page_size": page_size,
                "max_pages": op.shape("page_table")[1], "num_splits": op.grid[2],
                "scale": scale, "num_pages": num_pages,
                "max_pos": op.shape("rope")[0], "has_qk_norm": int(op.has("q_norm")),
                "eps": op.attrs["eps"], "parts": _parts(op.grid, kv_heads),
                "split_positions": int(op.attrs["split_positions"])}

    def region(self, op: OpView, operand: str, point: tuple[int, int, int]) -> Box:
        box = super().region(op, operand, point)
        kv_heads = op.shape("k_cache")[2]
        parts = _parts(op.grid, kv_heads)
        if parts == 1 or operand not in ("qkv", "k_cache", "v_cache"):
            return box
        head, dim = point[0] // parts, 1 if operand == "qkv" else 2
        size = op.shape(operand)[dim] // kv_heads  # qkv: (G+2)*D columns a KV head
        return box[:dim] + ((head * size, (head + 1) * size),) + box[dim + 1:]

    def scratch_bytes(self, op: OpView) -> int:
        # sm90.cuh's Layout: per-warp (m, l, O) states, a block's keys per warp (heads up to
        # 128: kStageKeys), the P transposes, the prepared queries, this step's keys and values
        # (up to one per batch row: a run's width), the per-warp RoPE buffers, the prologue's
        # setup, RoPE rows (one per batch row) and norm weights, the op's page-table row (every
        # entry a row can use: a fixed 1,024 kept llama-3.2-1b b1 at 10 weight pages, and each
        # page it lacked cost it ~1.3%: perf-log, forty-first session);
        # with several splits at least the merge's staged partials (every split's o and lse)
        d = op.shape("k_cache")[3]
        group, batch = self.param_values(op)["group"], op.shape("qkv")[0]
        keys = 8 * 16 * d * 2 if d <= SMALL_HEAD_DIM else 0
        layout = (8 * 8 * d * 4 + keys + 2 * 8 * 8 * 4 + 8 * 2 * 8 * 16 * 2
                  + -(-group * d * 2 // 16) * 16
                  + 2 * batch * d * 2 + 8 * d * 4 + 64 + batch * d * 4 + 2 * d * 4
                  + -(-4 * op.shape("page_table")[1] // 16) * 16)
        splits = op.grid[2]
        return max(layout, splits * group * (d + 1) * 4 if splits > 1 else 0)

    def reference(self, tile: Tile) -> None:
        p = self.param_values(tile.op)
        d, group = p["head_dim"], p["group"]
        heads = tile["qkv"].shape[1] // ((group + 2) * d)
        row = tile.point[1]  # qkv holds every row (a run reads its earlier rows' keys)
        index, width = runs.row_run(tile["runs"][0] if tile.has("runs") else None, row)
        pos = int(tile["positions"][0]) + tile.step * width
        if not 0 <= pos < p["max_pos"]:
            used = effective_splits(1, p["num_splits"], p["split_positions"])
            self._write_result(tile, None, None, p, used)
            return
        q, k, v = self._vectors(tile, row, pos, heads, group, d, p)
        # This step's keys and values of the run's rows up to this one, by position.
        fresh = {pos: (k, v)}
        fresh.update({pos - j: self._vectors(tile, row - j, pos - j, heads, group, d, p)[1:]
                      for j in range(1, index + 1) if pos - j >= 0})
        length = pos + 1
        used = effective_splits(length, p["num_splits"], p["split_positions"])
        chunk = math.ceil(length / used)
        part, split = tile.point[0] % p["parts"], tile.point[2]  # the task's query-head part
        if part == 0 and pos // chunk == split:  # part 0 of the split covering pos appends
            self._append(tile, pos, *fresh[pos], p)
        if split >= used:  # attends to nothing, writes nothing (but arrives: _write_result)
            self._write_result(tile, None, None, p, used)
            return
        lo, hi = split * chunk, min(length, (split + 1) * chunk)
        o, lse = _partial(q, tile, lo, hi, p, fresh)
        if p["num_splits"] == 1:
            # A part's heads of the whole group's result: torch's sums may round differently
            # for other shapes, and the parts must not change a value (the module doc).
            share = group // p["parts"]
            o = o[:, part * share: (part + 1) * share]
        self._write_result(tile, o, lse, p, used)

    def _vectors(self, tile: Tile, row: int, pos: int, heads: int, group: int, d: int, p: dict
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row `row`'s q [heads, G, D], k and v [heads, D] at position `pos`: q and k normed
        (Qwen3) and rotated in fp32, each rounded to bf16 once, v as is."""
        vecs = tile["qkv"][row].float().reshape(heads, group + 2, d)
        q, k, v = vecs[:, :group], vecs[:, group], vecs[:, group + 1]
        if tile.has("q_norm"):
            q = rmsnorm_rows(q, tile["q_norm"], p["eps"])
            k = rmsnorm_rows(k, tile["k_norm"], p["eps"])
        cos, sin = tile["rope"][pos, : d // 2], tile["rope"][pos, d // 2:]
        return bf16(rope_rotate(q, cos, sin)), bf16(rope_rotate(k, cos, sin)), v

    def _append(self, tile: Tile, pos: int, k: torch.Tensor, v: torch.Tensor, p: dict) -> None:
        """Write the key and value of `pos` to the row's page (the covering split's task)."""
        page_index = pos // p["page_size"]
        if page_index < p["max_pages"]:
            page = int(tile["page_table"][0, page_index])
            if 0 <= page < p["num_pages"]:
                slot = pos % p["page_size"]
                tile["k_cache"][page, slot].copy_(k)
                tile["v_cache"][page, slot].copy_(v)

    def _write_result(self, tile: Tile, o: torch.Tensor | None, lse: torch.Tensor | None,
                      p: dict, used: int) -> None:
        """out from o [heads, G', D] (None: a row outside the rope table, zeros) when the row
        uses one split (`used`: effective_splits), by split 0; with several, split s < used
        writes its partials (s >= used nothing), every split arrives and the one whose add
        completes the step's S merges the used splits' partials into out."""
        s = tile.point[2]
        if used == 1:
            if s == 0:
                out = tile["out"][0]
                if o is None:
                    out.zero_()
                else:
                    out.copy_(o.reshape(out.shape))
            return
        if s < used:
            if o is None:
                tile["part_o"][0, :, s].zero_()
                tile["part_lse"][0, :, s].fill_(-math.inf)
            else:
                tile["part_o"][0, :, s].copy_(o.reshape(tile["part_o"].shape[1], -1))
                tile["part_lse"][0, :, s].copy_(lse)
        if tile.arrive is None:
            raise AssertionError("attention with several KV splits runs where tasks arrive")
        if tile.arrive():
            tile["out"].copy_(merge_splits(tile["part_o"][:, :, :used],
                                           tile["part_lse"][:, :, :used]))

    def cost(self, op: OpView) -> TaskCost:
        # Decode attention cost grows with the context; the scheduler assumes 1k positions.
        # Every part of a KV head reads its keys and values.
        heads, d = op.shape("k_cache")[2:]
        batch = op.tile_shape("qkv")[0]
        kv_bytes = batch * 2 * 1024 * -(-heads // op.grid[0]) * d * 2 // op.grid[2]
        # The prologue stages the row's position, page-table slice, RoPE rows and norm weights
        # in two dependent round trips (sm90.cuh).
        return TaskCost(weight_bytes=0, act_bytes=kv_bytes, flops=kv_bytes * 2,
                        prologue_round_trips=2)


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor) -> torch.Tensor:
    """out [b, h*G*D] from the splits' partials part_o [b, h, S, G*D] and part_lse [b, h, S, G]:
    sum_s exp(lse_s - lse) * o_s with lse = log(sum_s exp(lse_s)); an all-empty head gives 0."""
    b, h, s, width = part_o.shape
    group = part_lse.shape[-1]
    total = torch.logsumexp(part_lse, dim=2, keepdim=True)  # [b, h, 1, G]
    weight = torch.exp(part_lse - total).nan_to_num(0.0)  # an all-empty head: -inf - -inf
    o = part_o.reshape(b, h, s, group, width // group)
    return (o * weight[..., None]).sum(dim=2).reshape(b, h * width)


def _parts(grid: tuple[int, ...], kv_heads: int) -> int:
    """Query-head parts of each KV head: grid axis 0 holds KV heads x parts."""
    return max(1, grid[0] // kv_heads)


def _partial(q: torch.Tensor, tile: Tile, lo: int, hi: int, p: dict,
             fresh: dict[int, tuple[torch.Tensor, torch.Tensor]]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [heads, G, D] over positions [lo, hi) of the tile's row: (o, lse).
    Positions whose page is outside the page table or the pool are masked out; the keys and
    values of `fresh` positions (this step's) come from there, the others from the cache."""
    heads, group, d = q.shape
    pos = torch.arange(lo, max(lo, hi))
    index = pos // p["page_size"]
    pos = pos[index < p["max_pages"]]
    pages = tile["page_table"][0, pos // p["page_size"]].long()
    valid = (pages >= 0) & (pages < p["num_pages"])
    pos, pages = pos[valid], pages[valid]
    if len(pos) == 0:
        return torch.zeros_like(q), torch.full((heads, group), -math.inf)
    slots = pos % p["page_size"]
    k = tile["k_cache"][pages, slots].float()  # [n, heads, D]
    v = tile["v_cache"][pages, slots].float()
    for i, position in enumerate(pos.tolist()):
        if position in fresh:
            k[i], v[i] = fresh[position][0].float(), fresh[position][1].float()
    scores = torch.einsum("hgd,nhd->hgn", q, k) * p["scale"]
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.einsum("hgn,nhd->hgd", torch.exp(scores - lse[..., None]), v)
    return o, lse
