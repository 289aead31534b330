"""mpk check's comparison rules."""

from __future__ import annotations

import torch

from mpk.check import CheckRow, _argmax_row, _compare


def test_argmax_index_may_differ_only_at_a_near_tie() -> None:
    logits = torch.randn(1, 64)
    logits[0, 5], logits[0, 9] = 10.0, 10.0 - 1e-4
    row = CheckRow("argmax_idx", 1.0, 0.0, False)
    near = [{"logits": logits, "argmax_idx": torch.tensor([[5]])},
            {"logits": logits, "argmax_idx": torch.tensor([[9]])}]
    assert _argmax_row(near, row).passed
    far = [near[0], {"logits": logits, "argmax_idx": torch.tensor([[0]])}]
    assert not _argmax_row(far, row).passed


def test_equal_infinities_and_nan() -> None:
    a = torch.tensor([float("-inf"), 1.0, 2.0])
    assert _compare("lse", a.clone(), a).passed
    assert not _compare("lse", torch.tensor([0.0, 1.0, 2.0]), a).passed
    assert not _compare("x", torch.tensor([float("nan"), 1.0, 2.0]), a.nan_to_num(0.0)).passed
    assert _compare("x", a.nan_to_num(0.0, 0.0, 0.0) * 1.001, a.nan_to_num(0.0, 0.0, 0.0)).passed
