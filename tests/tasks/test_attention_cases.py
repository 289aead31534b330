"""The GPU attention tests' row layouts are well posed (tests/gpu/test_kernels_attention.py
case_rows, checked without a GPU): in no step does a row read from the cache a slot another row
writes, which the GPU does not order. The sixteenth session found the bad-run-words case was not
(rows of one sequence whose clamped words made one treat another's position of the step as
cached): it passed on the H200 by timing until a kernel change moved the read earlier."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_kernels_attention import BAD_RUN_WORDS, case_rows
from tests.gpu.kernel_helpers import gen

# (lengths, widths, runs, steps, max_pages, max_pos) of the GPU cases that use runs or steps
CASES = [
    ((1, 17, 300), None, None, 1, None, None),
    ((2000, 33), None, None, 2, None, None),
    ((5, 40), None, None, 1, None, 32),
    ((1, 40, 17, 300), (5, 1, 3, 1), None, 2, None, None),
    ((30,), (16,), None, 1, None, None),
    ((3, 20, 9, 5, 12), None, BAD_RUN_WORDS, 2, None, None),
    ((26,), (4,), None, 3, 2, 64),
]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_the_gpu_cases_are_well_posed(case) -> None:  # type: ignore[no-untyped-def]
    rows = case_rows(gen(0), *case)
    assert len(rows.starts) == rows.table.shape[0] == rows.runs.shape[0]


def test_bad_run_words_on_rows_of_one_sequence_are_refused() -> None:
    # Row 1 of the first sequence, clamped to a run of its own, reads position 2 as cached
    # while row 0 writes it in the same step.
    with pytest.raises(AssertionError, match="row 1 reads position 2 from the cache while row 0"):
        case_rows(gen(0), (3, 20, 9), (2, 1, 2), BAD_RUN_WORDS, 2, None, None)


@pytest.mark.parametrize("group,parts,widths", [(4, 2, None), (8, 4, None), (4, 4, (5, 1, 3))])
def test_query_head_parts_change_no_value(group, parts, widths) -> None:
    """Query-head parts (task.py) split the work, not the arithmetic: on the interpreter every
    output and both caches equal the unparted op's bit for bit, over two steps (the second reads
    the keys the first appended: only part 0 appends)."""
    from mpk.compiler.lower import compile_graph
    from tests.gpu.kernel_helpers import run_on
    from tests.gpu.test_kernels_attention import attention_problem

    lengths = (1, 17, 30)
    got = []
    for p in (1, parts):
        graph, inputs, outputs = attention_problem(group, 64, 1, lengths, steps=2, seed=7,
                                                   widths=widths, parts=p)
        got.append(run_on(compile_graph(graph, num_sms=132), "cpu", inputs,
                          outputs + ["k_cache", "v_cache"], steps=2))
    for name, value in got[0].items():
        assert torch.equal(value.view(torch.int16), got[1][name].view(torch.int16)), name


def test_query_head_parts_must_divide_the_group() -> None:
    from mpk.errors import GraphError
    from tests.gpu.test_kernels_attention import attention_problem

    with pytest.raises(GraphError, match="P dividing the group 6"):
        attention_problem(6, 64, 1, (1, 17), kv_heads=2, parts=4)
    with pytest.raises(GraphError, match="P > 1 only with one split"):
        attention_problem(4, 64, 2, (1, 17), parts=2)
