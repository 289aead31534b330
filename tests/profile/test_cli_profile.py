"""`mpk profile` on a machine without a GPU: one clear line, exit 2 (like `mpk bench`)."""

from __future__ import annotations

import pytest
import torch

from mpk.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_profile_without_a_gpu_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["profile", "--model", "tiny-llama", "--steps", "4"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpk: error:") and "GPU" in lines[0]


def test_profile_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["profile", "--help"])
    out, _ = capsys.readouterr()
    assert info.value.code == 0
    assert "mpk profile --model" in out and "--steps" in out and "--out" in out
