"""Engine on the CPU interpreter: greedy tokens equal the PyTorch reference model's."""

from __future__ import annotations

import pytest
import torch

from mpk.engine import Engine, InvalidRequestError
from mpk.errors import MpkError, UnsupportedError
from mpk.models import get_preset, random_weights
from mpk.models.reference import ReferenceModel
from mpk.backends.registry import create_executor
from mpk.testing import Stream, StreamOrdered, greedy_mismatches

PROMPTS = [[3, 1, 4, 1, 5], [9], [2, 7, 1]]
NEW = 12
MAX_SEQ = 32


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-llama"])
def model(request: pytest.FixtureRequest) -> tuple:
    cfg = get_preset(request.param)
    weights = random_weights(cfg, seed=0)
    ref = ReferenceModel(cfg, weights, max_seq=MAX_SEQ)
    return cfg, weights, ref.generate_greedy(PROMPTS, NEW), ref


@pytest.mark.parametrize("steps_per_launch", [4, 16])
@pytest.mark.parametrize(("prefill_rows", "prefill_chunk"), [(1, 0), (16, 0), (16, 256)])
def test_batch_of_different_lengths_matches_reference(model: tuple, steps_per_launch: int,
                                                      prefill_rows: int,
                                                      prefill_chunk: int) -> None:
    """One position per step (prefill_rows 1, no prefill plan), long prompts fed as runs on
    the 16-row plan, or through the prefill plan (both share the batch's KV cache): the same
    greedy tokens every way."""
    cfg, weights, _, ref = model
    engine = Engine(cfg, weights, backend="cpu", max_seq_len=MAX_SEQ,
                    steps_per_launch=steps_per_launch, prefill_rows=prefill_rows,
                    prefill_chunk=prefill_chunk)
    result = engine.generate(PROMPTS, NEW)
    assert not greedy_mismatches(ref, PROMPTS, result.token_ids)
    steps = max(len(p) for p in PROMPTS) + NEW - 1
    if prefill_rows == 1 or max(map(len, PROMPTS)) <= steps_per_launch:
        assert result.timings["steps"] == steps
        assert result.timings["launches"] == -(-steps // steps_per_launch)
    else:
        assert result.timings["steps"] < steps
        assert set(engine.plans) == {len(PROMPTS)}  # the prefill plan is not a batch's plan
    for key in ("compile_s", "load_s", "prefill_s", "decode_s", "ms_per_token"):
        assert result.timings[key] >= 0


def test_launches_started_ahead_in_stream_order_match_reference(
        model: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every slot decoding: each launch starts before the last one's tokens are read, its rows
    embedding their own last samples. Through a CUDA stream's ordering (StreamOrdered: writes
    and launches run when waited for, in issue order) the tokens are still the reference's."""
    import mpk.engine.engine as engine_module

    cfg, weights, _, ref = model
    stream = Stream()

    def ordered(plan, backend, device=None):  # type: ignore[no-untyped-def]
        return StreamOrdered(create_executor(plan, backend, device=device), stream)

    monkeypatch.setattr(engine_module, "create_executor", ordered)
    engine = Engine(cfg, weights, backend="cpu", max_seq_len=MAX_SEQ, steps_per_launch=4,
                    prefill_rows=1)
    result = engine.generate(PROMPTS, NEW)
    assert not greedy_mismatches(ref, PROMPTS, result.token_ids)
    assert result.timings["overlapped_launches"] >= 2


def test_eos_truncates_each_row_after_its_first_eos(model: tuple) -> None:
    cfg, weights, expected, _ = model
    eos = expected[0][3]
    engine = Engine(cfg, weights, backend="cpu", max_seq_len=MAX_SEQ, steps_per_launch=4)
    result = engine.generate(PROMPTS, NEW, eos_token_ids=[eos])
    cut = [row[: row.index(eos) + 1] if eos in row else row for row in expected]
    assert result.token_ids == cut
    assert len(result.token_ids[0]) <= 4


def test_plans_are_cached_per_batch_size_and_reruns_agree() -> None:
    cfg = get_preset("tiny-qwen3")
    weights = random_weights(cfg, seed=1)
    engine = Engine(cfg, weights, backend="cpu", max_seq_len=MAX_SEQ, steps_per_launch=8)
    first = engine.generate([[5, 6]], 6)
    assert first.timings["compile_s"] > 0
    again = engine.generate([[5, 6]], 6)
    assert again.token_ids == first.token_ids  # stale KV data from the first run is not read
    assert again.timings["compile_s"] == 0 and again.timings["load_s"] == 0
    engine.generate([[5, 6], [7]], 3)
    assert sorted(engine.plans) == [1, 2]
    ref = ReferenceModel(cfg, weights, max_seq=MAX_SEQ)
    assert not greedy_mismatches(ref, [[5, 6]], first.token_ids)


@pytest.mark.parametrize(("prompts", "max_new", "message"), [
    ([[1], []], 4, "prompt 1 is empty"),
    ([[1, 256]], 4, r"token id 256 is outside the vocabulary \[0, 256\)"),
    ([[1] * 30], 4, "needs 33 positions, more than max_seq_len=32"),
    ([], 4, "no prompts"),
])
def test_bad_requests_raise_before_running(prompts: list, max_new: int, message: str) -> None:
    cfg = get_preset("tiny-llama")
    engine = Engine(cfg, random_weights(cfg, seed=0), backend="cpu", max_seq_len=MAX_SEQ)
    with pytest.raises(InvalidRequestError, match=message):
        engine.generate(prompts, max_new)
    assert engine.plans == {}


def test_bad_engine_options() -> None:
    cfg = get_preset("tiny-llama")
    weights = random_weights(cfg, seed=0)
    with pytest.raises(UnsupportedError, match="unknown backend"):
        Engine(cfg, weights, backend="tpu")
    with pytest.raises(MpkError, match="steps_per_launch must be a positive integer"):
        Engine(cfg, weights, steps_per_launch=0)
    with pytest.raises(MpkError, match="prefill_rows must be a positive integer"):
        Engine(cfg, weights, prefill_rows=0)
    with pytest.raises(MpkError, match="prefill_rows must be at most 16"):
        Engine(cfg, weights, prefill_rows=17)
    with pytest.raises(MpkError, match="prefill_chunk must be an integer >= 0"):
        Engine(cfg, weights, prefill_chunk=-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_backend_without_a_gpu_is_a_clear_error() -> None:
    cfg = get_preset("tiny-llama")
    with pytest.raises(UnsupportedError, match="needs a CUDA GPU"):
        Engine(cfg, random_weights(cfg, seed=0), backend="cuda")
