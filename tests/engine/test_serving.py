"""The serving loop on the CPU interpreter with a tiny model: requests submitted from another
thread at staggered times, more than the slots, get their solo greedy tokens; drain and cancel."""

from __future__ import annotations

import threading
import time

import pytest

from mpk.engine import Engine, FinishReason, SamplingParams
from mpk.engine.serving import EngineStoppedError
from mpk.models.config import get_preset
from mpk.models.reference import ReferenceModel
from mpk.models.weights import random_weights
from mpk.testing import greedy_mismatches

SEED = 4242
PROMPTS = [[1, 5, 9, 3], [7, 2], [4, 4, 4, 4, 4, 1], [9], [3, 3, 8, 1, 2]]


@pytest.fixture(scope="module")
def model():
    cfg = get_preset("tiny-llama")
    return cfg, random_weights(cfg, seed=SEED)


def test_staggered_requests_match_the_reference(model) -> None:
    cfg, weights = model
    engine = Engine(cfg, weights, backend="cpu", num_sms=4, max_seq_len=64, steps_per_launch=4,
                    progress=False)
    engine.start(max_batch=2)
    handles = []

    def client() -> None:
        for i, p in enumerate(PROMPTS):
            handles.append(engine.submit(p, SamplingParams(max_tokens=6 + i)))
            time.sleep(0.05 * i)

    thread = threading.Thread(target=client)
    thread.start()
    thread.join()
    got = [h.result(timeout=120).token_ids for h in handles]
    engine.stop()
    assert [len(g) for g in got] == [6 + i for i in range(len(PROMPTS))]
    bad = greedy_mismatches(ReferenceModel(cfg, weights, max_seq=64), PROMPTS, got)
    assert not bad, "; ".join(bad)
    assert engine.scheduler is None


def test_a_lone_request_decodes_on_the_one_row_plan(model) -> None:
    """Two slots, one request: once its prompt is fed (here by the prefill plan) it decodes on
    the one-row plan on the same KV cache; its tokens are the reference's."""
    cfg, weights = model
    engine = Engine(cfg, weights, backend="cpu", num_sms=4, max_seq_len=64, steps_per_launch=4,
                    progress=False)
    engine.start(max_batch=2)
    prompt = [4, 4, 4, 4, 4, 1]
    got = engine.submit(prompt, SamplingParams(max_tokens=9)).result(timeout=120).token_ids
    rows = list(engine.scheduler.stats.decode_rows)
    engine.stop()
    assert rows and set(rows) == {1}, rows
    bad = greedy_mismatches(ReferenceModel(cfg, weights, max_seq=64), [prompt], [got])
    assert not bad, "; ".join(bad)


def test_drain_finishes_then_refuses_and_cancel_frees(model) -> None:
    cfg, weights = model
    engine = Engine(cfg, weights, backend="cpu", num_sms=4, max_seq_len=64, steps_per_launch=2,
                    progress=False)
    engine.start(max_batch=1)
    long = engine.submit([1, 2, 3], SamplingParams(max_tokens=40))
    queued = engine.submit([4], SamplingParams(max_tokens=3))
    first = next(iter(long))  # wait until the long one runs
    long.cancel()
    assert queued.result(timeout=60).token_ids and queued.result().finish_reason is \
        FinishReason.LENGTH
    result = long.result(timeout=60)
    assert result.finish_reason is FinishReason.CANCELLED and result.token_ids[0] == first
    assert len(result.token_ids) < 40
    sched = engine.scheduler
    engine.stop(drain=True)
    assert sched.pool.num_free == sched.pool.num_pages  # every page came back
    with pytest.raises(Exception, match="start"):
        engine.submit([1], SamplingParams(max_tokens=1))
    engine.start(max_batch=1)
    engine._serving._stopping = True  # a stop in progress refuses new work
    with pytest.raises(EngineStoppedError):
        engine.submit([1], SamplingParams(max_tokens=1))
    engine.stop()


def test_seeded_sampling_reproduces_and_the_narrowest_filters_are_greedy(model) -> None:
    cfg, weights = model
    engine = Engine(cfg, weights, backend="cpu", num_sms=4, max_seq_len=64, steps_per_launch=4,
                    progress=False)
    engine.start(max_batch=2)
    prompt = [1, 5, 9, 3]
    runs = [engine.submit(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=s))
            for s in (11, 11, 12)]
    a, b, c = (h.result(timeout=120).token_ids for h in runs)
    assert a == b and a != c  # the seed fixes the tokens, whatever ran beside them
    greedy = engine.submit(prompt, SamplingParams(max_tokens=12)).result(timeout=120).token_ids
    # top_k 1 keeps the argmax alone; so does a nucleus smaller than the top token's probability
    # (random weights: no exact ties at the top)
    narrow = [engine.submit(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=11, **f))
              for f in ({"top_k": 1}, {"top_p": 1e-6})]
    assert [h.result(timeout=120).token_ids for h in narrow] == [greedy, greedy]
    wide = engine.submit(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=11,
                                                top_k=cfg.vocab_size, top_p=1.0))
    assert wide.result(timeout=120).token_ids == a  # no-op filters: the plain sample
    engine.stop()
