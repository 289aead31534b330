"""The fused attention kernel (q/k norm, RoPE, KV append, attention; tasks/attention/sm90.cuh)
against the CPU interpreter: head dims 16-256, GQA groups, KV splits, steps, runs of rows that
share a sequence, rows outside the rope table, pages outside the pool (kernel_helpers.py:
poisoned outputs, bf16 tolerance)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from mpk.graph.graph import Graph
from mpk.tasks.runs import row_run
from tests.gpu.kernel_helpers import (BF16, F32, I32, Role, add_qk_norms, assert_close, gen,
                                      randn, rope_table, run_both)

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]


def attention_case(group: int, d: int, splits: int, lengths=(1, 17, 300), steps: int = 1,
                   qk_norm: bool = True, kv_heads: int = 2, max_pos: int | None = None,
                   seed: int = 0, widths: tuple[int, ...] | None = None,
                   runs: list[list[int]] | None = None, max_pages: int | None = None,
                   parts: int = 1, split_positions: int = 0) -> None:
    """One row per length, or with `widths` a run of widths[j] rows per length (tasks/runs.py:
    row i of run j starts at position lengths[j] - 1 + i and shares the run's pages). `runs`
    replaces the rows' RUNS words (bad words are clamped alike on both sides); `max_pages`
    the page table's width; `parts` the query-head parts of each KV head (task.py);
    `split_positions` the op's attr (a row uses fewer splits while its context is short: the
    unused splits' partials stay poisoned, so only out and the caches are compared)."""
    graph, inputs, outputs = attention_problem(group, d, splits, lengths, steps, qk_norm,
                                               kv_heads, max_pos, seed, widths, runs,
                                               max_pages, parts, split_positions)
    compare_both(graph, inputs, outputs[:1] if split_positions else outputs, steps)


def compare_both(graph: Graph, inputs: dict[str, torch.Tensor], outputs: list[str],
                 steps: int) -> None:
    cpu, gpu = run_both(graph, inputs, outputs + ["k_cache", "v_cache"], steps=steps)
    for name in outputs + ["k_cache"]:
        assert_close(cpu[name], gpu[name], name)
    assert_close(cpu["v_cache"], gpu["v_cache"], "v_cache", exact=True)


def attention_problem(group: int, d: int, splits: int, lengths=(1, 17, 300), steps: int = 1,
                      qk_norm: bool = True, kv_heads: int = 2, max_pos: int | None = None,
                      seed: int = 0, widths: tuple[int, ...] | None = None,
                      runs: list[list[int]] | None = None, max_pages: int | None = None,
                      parts: int = 1, split_positions: int = 0
                      ) -> tuple[Graph, dict[str, torch.Tensor], list[str]]:
    """attention_case's graph (one attention op), its inputs and its outputs' names."""
    g = gen(seed)
    rows = case_rows(g, lengths, widths, runs, steps, max_pages, max_pos)
    starts, runs, table, max_pos = rows.starts, rows.runs, rows.table, rows.max_pos
    batch, max_pages, page_size = len(starts), table.shape[1], PAGE_SIZE
    cache = (rows.num_pages, page_size, kv_heads, d)
    width = kv_heads * (group + 2) * d
    graph = Graph()
    graph.add_tensor("qkv", (batch, width), BF16, Role.IO)
    graph.add_tensor("rope", (max_pos, d), F32, Role.WEIGHT)
    graph.add_tensor("positions", (batch,), I32, Role.IO)
    graph.add_tensor("page_table", (batch, max_pages), I32, Role.IO)
    graph.add_tensor("k_cache", cache, BF16, Role.IO)
    graph.add_tensor("v_cache", cache, BF16, Role.IO)
    graph.add_tensor("runs", (batch, 2), I32, Role.IO)
    operands = {"qkv": "qkv", "rope": "rope", "positions": "positions", "runs": "runs",
                "page_table": "page_table", "k_cache": "k_cache", "v_cache": "v_cache"}
    inputs = {"qkv": randn((batch, width), torch.bfloat16, g, 2.0),
              "rope": rope_table(max_pos, d),
              "positions": torch.tensor(starts, dtype=torch.int32),
              "runs": runs, "page_table": table, "k_cache": randn(cache, torch.bfloat16, g),
              "v_cache": randn(cache, torch.bfloat16, g)}
    if qk_norm:
        add_qk_norms(graph, inputs, operands, d, g)
    graph.add_tensor("o", (batch, kv_heads * group * d), BF16, Role.ACTIVATION)
    operands["out"] = "o"
    outputs = ["o"]
    if splits > 1:  # the splits' partials too (the last split merges them into o)
        graph.add_tensor("po", (batch, kv_heads, splits, group * d), F32, Role.ACTIVATION)
        graph.add_tensor("pl", (batch, kv_heads, splits, group), F32, Role.ACTIVATION)
        operands.update(part_o="po", part_lse="pl")
        outputs += ["po", "pl"]
    graph.add_op("attention", "attn", (kv_heads * parts, batch, splits), operands=operands,
                 split_positions=split_positions)
    return graph, inputs, outputs


PAGE_SIZE = 16


@dataclass(frozen=True)
class CaseRows:
    starts: list[int]     # each row's position at step 0
    runs: torch.Tensor    # [B, 2] run words
    table: torch.Tensor   # [B, max_pages] page table (a run's rows share their sequence's)
    num_pages: int
    max_pos: int


def case_rows(g: torch.Generator, lengths: tuple[int, ...], widths: tuple[int, ...] | None,
              runs: list[list[int]] | None, steps: int, max_pages: int | None,
              max_pos: int | None) -> CaseRows:
    """attention_case's rows: a sequence per length (its pages a random slice of the pool),
    widths[j] rows in sequence j's run; checked well posed (assert_well_posed)."""
    widths = widths or (1,) * len(lengths)
    max_pages = max_pages or (max(n + steps * w for n, w in zip(lengths, widths)) +
                              PAGE_SIZE - 1) // PAGE_SIZE + 1
    num_pages = len(lengths) * max_pages
    seq_pages = torch.randperm(num_pages, generator=g).to(torch.int32).reshape(-1, max_pages)
    rows = [(j, i) for j, w in enumerate(widths) for i in range(w)]
    table = torch.stack([seq_pages[j] for j, _ in rows])
    words = torch.tensor(runs or [[i, widths[j]] for j, i in rows], dtype=torch.int32)
    max_pos = max_pos or max_pages * PAGE_SIZE
    starts = [lengths[j] - 1 + i for j, i in rows]
    assert_well_posed(starts, words, table, steps, min(max_pos, max_pages * PAGE_SIZE),
                      PAGE_SIZE)
    return CaseRows(starts, words, table, num_pages, max_pos)


def assert_well_posed(starts: list[int], runs: torch.Tensor, table: torch.Tensor, steps: int,
                      limit: int, page_size: int) -> None:
    """A case is well posed only if, in every step, no two rows write the same cache slot and
    no row reads from the cache a slot another row writes (a row reads the cached positions
    before its run's rows of the step): the GPU orders neither (the interpreter runs the rows in
    order, so it would see the other row's write). Clamped run words can make a row treat
    positions another row writes now as cached ones."""
    def slot(row: int, pos: int) -> tuple[int, int]:
        return int(table[row, pos // page_size]), pos % page_size

    for step in range(steps):
        written: dict[tuple[int, int], int] = {}
        for row, start in enumerate(starts):
            pos = start + step * row_run(runs[row], row)[1]
            if pos < limit:
                assert slot(row, pos) not in written, \
                    f"test bug: rows share a cache slot at step {step}"
                written[slot(row, pos)] = row
        for row, start in enumerate(starts):
            index, width = row_run(runs[row], row)
            pos = start + step * width
            if pos >= limit:
                continue  # attends to nothing
            for q in range(min(pos - index, table.shape[1] * page_size)):
                writer = written.get(slot(row, q), row)
                assert writer == row, (f"test bug: row {row} reads position {q} from the cache "
                                       f"while row {writer} writes it at step {step}")


@pytest.mark.parametrize("d", [16, 32, 64, 80, 96, 128, 256])
def test_attention_head_dims(d):
    attention_case(2, d, 1, seed=d)


@pytest.mark.parametrize("group,splits,qk_norm", [(2, 4, True), (4, 1, False), (8, 2, True),
                                                  (12, 1, True), (1, 3, False), (12, 2, True)])
def test_attention_groups_and_splits(group, splits, qk_norm):
    """Outputs up to 16 KB and groups up to 8 are flagged (task.py flag_operands: the merge
    writes words), (12, 2) merges into a plain out."""
    attention_case(group, 128, splits, qk_norm=qk_norm, seed=group * 10 + splits)


@pytest.mark.parametrize("group,parts,d", [(4, 2, 128), (8, 8, 128), (4, 4, 256), (12, 4, 64)])
def test_attention_query_head_parts(group, parts, d):
    """Each KV head's query heads over `parts` tasks (the builder's choice at small batches):
    every part prepares its heads and the head's key and value, part 0 appends."""
    attention_case(group, d, 1, lengths=(1, 17, 300), steps=2, parts=parts, seed=40 + parts)


def test_attention_query_head_parts_with_runs():
    attention_case(4, 128, 1, lengths=(1, 40, 17, 300), widths=(5, 1, 3, 1), steps=2, parts=2,
                   seed=47)


def test_attention_steps_and_long():
    attention_case(4, 128, 4, lengths=(2000, 33), steps=2, seed=3)


@pytest.mark.parametrize("splits,split_positions", [(1, 0), (3, 0), (3, 16)])
def test_attention_row_outside_the_rope_table(splits, split_positions):
    """A row whose position is past the rope table attends to nothing and appends nothing
    (with splits: every split's partials empty, and the merge's out zeros; with
    split_positions a one-position context: split 0 writes the zeros, nobody arrives)."""
    attention_case(2, 64, splits, lengths=(5, 40), max_pos=32, seed=9,
                   split_positions=split_positions)


def test_attention_cached_pages_outside_the_pool_are_masked():
    """Cached positions whose page entries lie outside the pool (-1; past the pool), each a
    whole warp block among attended ones: masked on both sides (zeros staged, no load), over
    two steps."""
    graph, inputs, outputs = attention_problem(2, 128, 1, lengths=(40, 300), steps=2, seed=41)
    table = inputs["page_table"]
    table[0, 1] = -1  # positions 16-31 of row 0: warp 1's first block
    table[1, 5] = graph.tensors["k_cache"].shape[0] + 3  # positions 80-95 of row 1
    compare_both(graph, inputs, outputs, steps=2)


@pytest.mark.parametrize("group", [2, 12])
def test_attention_splits_used_by_context(group):
    """split_positions 16 over 4 splits: rows of 1-32 positions use one split (split 0 writes
    out, nobody arrives), 40 three, 300 all four; the row at 31 uses three from the third step
    (33 positions) and its counter starts then. Group 2 writes a flagged out, 12 a plain one."""
    attention_case(group, 128, 4, lengths=(1, 31, 40, 300), steps=3, split_positions=16,
                   seed=60 + group)


def test_attention_sixteen_splits_over_three_steps():
    """The most KV splits an op may have (task.py MAX_SPLITS), a group of 8: the merging split
    stages 16 x 8 x 129 f32 words; three steps, so each (row, head)'s arrival counter completes
    three times and a different split may merge each time."""
    attention_case(8, 128, 16, lengths=(1, 200, 700), steps=3, seed=16)


@pytest.mark.parametrize("splits", [1, 3])
def test_attention_runs_read_their_earlier_rows_of_the_step(splits):
    """Runs of 5 and 3 rows beside rows alone (chunked prefill in the batch, tasks/runs.py):
    each run row attends to the cache and to its earlier rows' keys of the same step, over
    two steps (positions move by the run's width)."""
    attention_case(2, 128, splits, lengths=(1, 40, 17, 300), widths=(5, 1, 3, 1), steps=2,
                   seed=21 + splits)


def test_attention_a_run_of_sixteen_rows_at_head_dim_256():
    attention_case(4, 256, 1, lengths=(30,), widths=(16,), qk_norm=False, seed=5)


BAD_RUN_WORDS = [[5, 0], [-3, -1], [9, 2], [1, 4], [7, 2]]


def test_attention_bad_run_words_are_clamped_alike():
    """Index past the row or the width, width 0 or negative: the kernel clamps the words as
    tasks/runs.py does (a wrong answer for that row at worst, never an access outside it).
    Each row has a sequence of its own: bad words on rows sharing one made a row read, as
    cached, a slot another row wrote in the same step, which the GPU does not order (it
    passed by timing until the sixteenth session; assert_well_posed now refuses it)."""
    attention_case(2, 64, 2, lengths=(3, 20, 9, 5, 12), runs=BAD_RUN_WORDS, steps=2, seed=31)


def test_attention_a_run_past_its_page_table():
    """A run whose later steps reach positions past the page table (inside the rope table):
    those positions are neither written nor attended, on both sides."""
    attention_case(2, 64, 1, lengths=(26,), widths=(4,), steps=3, max_pages=2, max_pos=64,
                   seed=32)
