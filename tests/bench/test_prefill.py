"""The torch prefill of `mpk bench --prefill`, eagerly on the CPU in float32: one call over the
whole prompt leaves the same KV cache and next-token logits as the baseline decoder fed one
token per step (which test_baseline.py checks against the reference model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpk.bench.baseline import StaticDecoder
from mpk.bench.prefill import random_prompt, torch_prefill
from mpk.engine import Engine, SamplingParams
from mpk.models.config import get_preset
from mpk.models.weights import random_weights
from mpk.testing import moe_top3_config

MAX_SEQ = 48


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama", "moe"])
def test_one_call_prefill_equals_token_by_token(name: str) -> None:
    cfg = moe_top3_config() if name == "moe" else get_preset(name)
    weights = {k: v.float() for k, v in random_weights(cfg, 3).items()}
    prompt = torch.randint(cfg.vocab_size, (29,), generator=torch.Generator().manual_seed(5))
    whole = StaticDecoder(cfg, weights, MAX_SEQ, batch=1, dtype=torch.float32)
    token = torch_prefill(whole, prompt)
    stepped = StaticDecoder(cfg, weights, MAX_SEQ, batch=1, dtype=torch.float32)
    with torch.no_grad():
        for p, t in enumerate(prompt.tolist()):
            logits = stepped.logits(torch.tensor([t]), torch.tensor(p))
    assert int(token) == int(logits.argmax())
    for a, b in zip(whole.layers, stepped.layers, strict=True):
        torch.testing.assert_close(a.k_cache[0, :, :29], b.k_cache[0, :, :29], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.v_cache[0, :, :29], b.v_cache[0, :, :29], rtol=1e-4, atol=1e-4)


def test_mpk_prefill_timing_on_the_interpreter() -> None:
    from mpk.bench.prefill import time_mpk_prefill

    cfg = get_preset("tiny-qwen3")
    for prefill_rows, want in ((8, 5), (16, 3)):  # 40 positions on the 8 slots / 16 rows
        engine = Engine(cfg, random_weights(cfg, 3), backend="cpu", num_sms=4, max_seq_len=64,
                        steps_per_launch=4, progress=False, prefill_rows=prefill_rows,
                        prefill_chunk=0)  # the rows path, as on the GPU
        ms, token, steps = time_mpk_prefill(engine, list(range(1, 41)), max_batch=8, repeats=2)
        assert ms > 0 and 0 <= token < cfg.vocab_size
        assert steps == want and engine.prefill_chunk == 0


def test_the_cli_prefill_mode_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from mpk.cli import main

    assert main(["bench", "--prefill", "8", "--serving", "--model", "tiny-llama"]) == 2
    assert "not both" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--prefill", "8", "--model", "tiny-llama"]) != 0
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_ab_prefill_reports_the_engines_first_token() -> None:
    """scripts/ab_prefill.py (the A/B runs' MPK-only prefill) on the interpreter: one JSON line
    whose token is the one the same engine gives its seeded prompt, one prefill-plan launch."""

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(root / "scripts" / "ab_prefill.py"), "--model", "tiny-qwen3",
           "--prompt", "40", "--chunk", "64", "--max-batch", "4", "--rounds", "1",
           "--backend", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    cfg = get_preset("tiny-qwen3")
    prompt = random_prompt(cfg.vocab_size, 40, 0)
    engine = Engine(cfg, random_weights(cfg, 0), backend="cpu", max_seq_len=56, prefill_rows=4,
                    prefill_chunk=64, progress=False)
    engine.start(max_batch=4)
    try:
        token = engine.submit(prompt, SamplingParams(max_tokens=1)).result().token_ids[0]
    finally:
        engine.stop()
    assert line["token"] == token and line["steps"] == 1 and len(line["ms"]) == 1
