"""Chunked prefill in the batch on the CPU interpreter: a long prompt fed as a run of rows (many
positions per step, tasks/runs.py) beside decoding requests gives the reference model's greedy
tokens, in far fewer steps than one position per step; a seeded sampled request draws the same
tokens whether its prompt ran as a run or one row at a time."""

from __future__ import annotations

import pytest

from mpk.engine import Engine, SamplingParams
from mpk.models.config import get_preset
from mpk.models.reference import ReferenceModel
from mpk.models.weights import random_weights
from mpk.testing import greedy_mismatches

SEED = 99
LONG = [(7 * i + 3) % 251 + 1 for i in range(45)]


def engine_for(name: str, steps: int = 4, prefill_rows: int = 16
               ) -> tuple[Engine, object, dict]:
    cfg = get_preset(name)
    weights = random_weights(cfg, seed=SEED)
    # No prefill plan: these tests are about runs of the decode batch (test_prefill_plan.py
    # covers the prefill plan).
    return Engine(cfg, weights, backend="cpu", num_sms=4, max_seq_len=96,
                  steps_per_launch=steps, progress=False, prefill_rows=prefill_rows,
                  prefill_chunk=0), cfg, weights


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama", "tiny-qwen3-moe"])
def test_a_long_prompt_beside_a_decoding_request_matches_the_reference(name: str) -> None:
    engine, cfg, weights = engine_for(name)
    engine.start(max_batch=4)
    try:
        short = engine.submit([5, 17, 2], SamplingParams(max_tokens=20))
        next(iter(short))  # the short request decodes before the long prompt arrives
        long = engine.submit(LONG, SamplingParams(max_tokens=5))
        prompts = [[5, 17, 2], LONG]
        got = [short.result(timeout=300).token_ids, long.result(timeout=300).token_ids]
        steps = engine.scheduler.stats.steps
    finally:
        engine.stop()
    assert [len(g) for g in got] == [20, 5]
    bad = greedy_mismatches(ReferenceModel(cfg, weights, max_seq=96), prompts, got)
    assert not bad, "; ".join(bad)
    # One position per step would need 45 + 4 steps for the long request alone.
    assert steps < 40


def test_seeded_sampling_is_the_same_from_a_run_and_from_one_row() -> None:
    """Equal here, not in general: runs and rows alone round alike up to the interpreter's
    matmul order (by row count), and this fixed-seed case is far from a flip."""
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=1234)
    narrow, _, _ = engine_for("tiny-qwen3", prefill_rows=1)
    alone = narrow.generate([LONG], max_new_tokens=8, sampling=params)
    assert alone.timings["steps"] == len(LONG) + 7  # one position per step
    engine, cfg, weights = engine_for("tiny-qwen3")
    wide = engine.generate([LONG], max_new_tokens=8, sampling=params)
    assert wide.token_ids == alone.token_ids
    assert wide.timings["steps"] < 20  # the prompt went in on the 16-row prefill plan
    alone = alone.token_ids[0]
    engine.start(max_batch=4)
    try:
        wide = engine.submit(LONG, params).result(timeout=300).token_ids
        steps = engine.scheduler.stats.steps
    finally:
        engine.stop()
    assert wide == alone
    assert steps < 30  # the prompt went in as a run


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-moe"])
def test_generate_feeds_a_long_prompt_on_the_prefill_plan(name: str) -> None:
    """Engine.generate of one prompt: the batch-1 plan decodes, the 16-row prefill plan (same
    KV cache, built on first use) feeds the prompt 16 positions a step."""
    engine, cfg, weights = engine_for(name, steps=8)
    result = engine.generate([LONG], max_new_tokens=10)
    bad = greedy_mismatches(ReferenceModel(cfg, weights, max_seq=96), [LONG], result.token_ids)
    assert not bad, "; ".join(bad)
    assert result.timings["steps"] <= -(-len(LONG) // 16) + 1 + 9
    again = engine.generate([LONG[:30]], max_new_tokens=10)  # both plans reused, pages too
    bad = greedy_mismatches(ReferenceModel(cfg, weights, max_seq=96), [LONG[:30]],
                            again.token_ids)
    assert not bad, "; ".join(bad)
    assert again.timings["compile_s"] == 0.0


def test_serving_builds_the_prefill_plan_at_start() -> None:
    """A server pays for its plans when it starts, not when the first long prompt (or the first
    lone request) arrives; generate builds the prefill plan only for a prompt that needs it."""
    engine, _, _ = engine_for("tiny-llama")
    engine.generate([[1, 2, 3]], max_new_tokens=2)  # short: fed on the batch-1 plan alone
    rows = engine.options.prefill_rows
    assert rows not in engine._runners[1].rows
    engine.start(max_batch=2)
    try:  # the prefill_rows plan and the one-row plan for a lone request
        assert set(engine._runners[2].rows) == {rows, 1}
    finally:
        engine.stop()
