"""mpk bench --serving on the CPU interpreter: the trace is seeded, every request's tokens equal
its solo run, and the report's numbers are consistent."""

from __future__ import annotations

import json

import pytest

from mpk.bench.serving import (RATE_LAUNCHES, make_trace, positions_needed, run_serving_bench,
                               window_rate)
from mpk.cli import main
from mpk.engine.engine import Engine
from mpk.models import get_preset, random_weights


def test_the_trace_is_seeded_and_in_range() -> None:
    a = make_trace(100, 50, (2, 40), (3, 9), rate=5.0, seed=1)
    assert a == make_trace(100, 50, (2, 40), (3, 9), rate=5.0, seed=1)
    assert a != make_trace(100, 50, (2, 40), (3, 9), rate=5.0, seed=2)
    assert all(2 <= len(p) <= 40 and max(p) < 100 for p in a.prompts)
    assert all(3 <= n <= 9 for n in a.max_tokens)
    assert list(a.arrivals_s) == sorted(a.arrivals_s) and a.arrivals_s[-1] > 0
    assert set(make_trace(100, 5, (2, 4), (3, 3), rate=0.0, seed=1).arrivals_s) == {0.0}
    assert positions_needed(a, 16) >= max(len(p) + n for p, n in zip(a.prompts, a.max_tokens))


def test_decode_rates_leave_out_the_tokens_that_came_with_the_first() -> None:
    # A launch feeding a 3-token prompt delivers the first token and 2 more at t = 1.0; two
    # launches of 2 tokens follow: 4 tokens in 2 s, not 5 (the 2 came before the window).
    assert window_rate([[1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]]) == (1.0, 3.0, 4, 2.0)
    # Together: from the last request's first token to the first request's last.
    start, end, counted, rate = window_rate([[1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 3.0]])
    assert (start, end, counted) == (2.0, 3.0, 2) and rate == 2.0
    assert window_rate([[1.0, 1.0]])[3] is None  # no time after the first token


def test_concurrent_requests_equal_their_solo_runs() -> None:
    cfg = get_preset("tiny-qwen3")
    trace = make_trace(cfg.vocab_size, 7, (1, 12), (2, 10), rate=0.0, seed=3)
    engine = Engine(cfg, random_weights(cfg, seed=0), backend="cpu", steps_per_launch=4,
                    max_seq_len=positions_needed(trace, 4), progress=False)
    result = run_serving_bench(engine, trace, max_batch=3)  # 7 requests on 3 slots: they queue
    assert result["outputs_equal_solo"] and result["mismatched_requests"] == []
    assert result["output_tokens"] == sum(trace.max_tokens)  # no EOS ids: full lengths
    assert result["single_request_tokens_per_s"] > 0 and result["output_tokens_per_s"] > 0
    assert result["ttft"]["p50_ms"] <= result["ttft"]["p99_ms"]
    assert 0 < result["tpot"]["p50_ms"] <= result["tpot"]["p99_ms"]
    split = result["launch_split"]["concurrent"]
    # Every output token came out of some launch's steps (a step gives each row at most one).
    assert split["launches"] >= 1 and split["steps"] * 3 >= result["output_tokens"]
    assert split["in_launches_s"] + split["between_launches_s"] == pytest.approx(
        result["wall_s"], abs=2e-3)
    single = result["launch_split"]["single"]
    assert single["steps"] >= 4 * 8 and single["ms_per_step_in_launches"] > 0  # 8 launches of 4
    # Prompts over one launch's steps went through the prefill plan, up to 3 (slots) a launch.
    assert 0 < split["prefill_launches"] <= split["launches"]
    assert 1 <= split["prompts_per_prefill_launch"] <= 3
    # The full batch: 3 requests of 32 tokens (8 launches of 4 steps) decoding together; its
    # window holds tokens of every request, at most all of their tokens after the first.
    full = result["full_batch"]
    assert full["requests"] == 3 and full["tokens_each"] == 32 and full["window_s"] > 0
    assert 3 <= full["tokens_in_window"] <= 3 * 31
    assert full["decode_tokens_per_s"] == pytest.approx(
        full["tokens_in_window"] / full["window_s"], rel=1e-3)
    # Against one request with the same short prompt (same context), not the trace's first.
    assert full["single_tokens_per_s"] > 0
    assert full["speedup_over_single"] == pytest.approx(
        full["decode_tokens_per_s"] / full["single_tokens_per_s"], rel=0.02)
    # Each full-batch pass's launches: the lone request's 32 tokens take >= 8 launches of 4
    # steps (its prompt may add some), the full batch's rows at most 4 tokens a launch each.
    alone, every = full["launch_split"]["alone"], full["launch_split"]["all_slots"]
    assert alone["launches"] >= 8 and alone["steps"] >= 31
    assert every["launches"] >= 8 and every["steps"] * 3 >= 3 * 32
    assert every["ms_per_step_in_launches"] > 0 and every["between_launches_s"] >= 0


def test_the_cli_serving_mode(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--serving", "--model", "tiny-llama", "--backend", "cpu",
                 "--requests", "4", "--prompt-len", "2:6", "--output-len", "2:5",
                 "--steps-per-launch", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["outputs_equal_solo"] and out["requests"] == 4
    assert out["full_batch"]["requests"] == 16 and out["full_batch"]["decode_tokens_per_s"] > 0
    assert out["full_batch"]["tokens_each"] == RATE_LAUNCHES * 4  # launches of 4 steps
    assert out["backend"] == "cpu" and out["max_batch"] == 16
    code = main(["bench", "--model", "tiny-llama", "--backend", "cpu"])
    assert code == 2 and "only with --serving" in capsys.readouterr().err
