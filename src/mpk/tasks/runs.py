"""Row runs: batch rows that hold consecutive positions of ONE sequence in the same step.

This is how a prompt is prefilled many tokens per step inside the decode batch (chunked
prefill): a run of `width` rows b0 .. b0+width-1 shares one page table; row b0+i starts the
launch at position positions[b0] + i and every step moves each row `width` positions on, so at
step s the run covers positions P .. P+width-1 with P = positions[b0] + s*width. Attention of row
b0+i sees the cached positions before P and the keys and values of rows b0 .. b0+i of this step
(taken from the step's qkv, since the other rows' cache writes of this step are not ordered with
it); sampling draws at the row's own position.

Layout (this module owns it; generated into the CUDA code as RUN_WORDS): runs [B, 2] i32, per
row (index of the row in its run, the run's width). A row alone is (0, 1); (0, 0), the value of
a zeroed buffer, means the same. The kernels clamp the words (width >= 1, 0 <= index <= min(b,
width - 1)) so a bad row can only compute a wrong answer for itself, never address outside the
batch.
"""

from __future__ import annotations

import torch

WORDS = 2
INDEX, WIDTH = 0, 1


def row_run(words: torch.Tensor | None, row: int) -> tuple[int, int]:
    """(index in the run, run width) of batch row `row` from its words (None: alone), clamped
    as the kernels clamp them."""
    if words is None:
        return 0, 1
    width = max(int(words[WIDTH]), 1)
    index = min(max(int(words[INDEX]), 0), width - 1, row)
    return index, width


def position(start: int, words: torch.Tensor | None, step: int) -> int:
    """A row's position at local step `step` of the launch (`start`: its positions entry)."""
    return start + step * row_run(words, 0)[1]


def encode(index: int, width: int) -> tuple[int, int]:
    """A row's words."""
    return index, width
