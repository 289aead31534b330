"""Every dense preset's plan leaves the CUDA runtime its weight pages at every batch size the
engine offers (1-16): found on the H200, qwen3-8b at batch 16 asked for 160 KB of task scratch
(lm_head's fp32 sums of a chunked input over ~1150 rows per task), which left 3 pages of the 4
the runtime needs, so `mpk serve --max-batch 16` could not start."""

from __future__ import annotations

import pytest

from mpk.backends.cuda import codegen
from mpk.compiler.lower import compile_graph
from mpk.graph.graph import DEFAULT_NUM_SMS
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import get_preset
from mpk.tasks.linear.task import (ACC_BUDGET, MAX_BATCH, chunk_k, min_tasks, x_budget,
                                   staged_bytes, staged_rows)


@pytest.mark.parametrize("model", ["qwen3-8b", "llama-3.1-8b", "qwen3-0.6b"])
def test_the_largest_batch_keeps_enough_weight_pages(model: str) -> None:
    plan = compile_graph(build_graph(get_preset(model), DecodeShape(batch=MAX_BATCH)),
                         DEFAULT_NUM_SMS)
    # num_pages raises UnsupportedError below MIN_PAGES (what the runtime needs; the page probe
    # streamed as fast with 4 pages as with 11, docs/perf-log.md).
    pages = codegen.num_pages(plan.scratch_bytes)
    assert pages >= codegen.MIN_PAGES, (model, plan.scratch_bytes, pages)


def test_min_tasks_caps_the_sums_of_a_chunked_input() -> None:
    n, k, batch = 151936, 4096, 16
    assert chunk_k(batch, k) < k  # this shape is staged in chunks
    tasks = min_tasks(n, k, batch)
    assert -(-n // tasks) * batch * 4 <= ACC_BUDGET
    assert min_tasks(n, k, 8) == 1  # one chunk: no sums kept


@pytest.mark.parametrize("k", [576, 1024, 2048, 3072, 4096, 12288, 14336])
def test_the_staged_input_fits_its_budget_at_every_batch(k: int) -> None:
    # sm90.cuh stages B rows, or 16 at batch 9-16 (rows past B zero, each row pair's A
    # fragments spread over rows p and p + 8): chunks are sized for the rows staged, so a chunk
    # of batch 9 takes as much shared memory as one of batch 16 and neither passes x_budget.
    for batch in range(1, MAX_BATCH + 1):
        xc = chunk_k(batch, k)
        assert xc % 32 == 0 and staged_bytes(batch, xc) <= x_budget(batch), (batch, k, xc)
        assert staged_rows(batch) == (batch if batch <= 8 else 16)
    assert staged_bytes(9, chunk_k(9, k)) == staged_bytes(16, chunk_k(16, k))


def test_batch_16_stages_a_k_of_3072_in_one_chunk() -> None:
    # qwen3-0.6b's down at batch 16 in one chunk (two cost a staging round trip in its walk:
    # 1.413 -> 1.363 ms a step, perf-log twelfth session); up to 8 rows, K up to 4,480 whole.
    assert chunk_k(16, 3072) == 3072
    assert chunk_k(16, 4096) < 4096
    assert chunk_k(8, 4096) == 4096


def test_attention_reserves_its_page_table_row_not_a_fixed_1024_entries() -> None:
    # A fixed 1,024 page-table entries (4 KB of attention's scratch) kept llama-3.2-1b at batch 1
    # to 10 weight pages; each page is worth ~1.3% of its step there (perf-log, forty-first
    # session). Its row of a 4,096-position plan is 256 entries: the plan keeps 11.
    shape = DecodeShape(batch=1, max_pages=256, num_pages=256)
    plan = compile_graph(build_graph(get_preset("llama-3.2-1b"), shape), DEFAULT_NUM_SMS)
    op = next(op for op in plan.ops if op.kind == "attention")
    assert plan.op_view(plan.ops.index(op)).tensors["page_table"].shape[1] == 256
    assert codegen.num_pages(plan.scratch_bytes) == 11
