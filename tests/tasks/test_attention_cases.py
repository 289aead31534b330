"""The GPU attention tests' row layouts are well posed (tests/gpu/test_kernels_attention.py
case_rows, checked without a GPU): in no step does a row read from the cache a slot another row
writes, which the GPU does not order. The sixteenth session found the bad-run-words case was not
(rows of one sequence whose clamped words made one treat another's position of the step as
cached): it passed on the H200 by timing until a kernel change moved the read earlier."""

from __future__ import annotations

import pytest

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
