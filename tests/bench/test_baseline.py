"""The torch.compile baseline's decoder, run eagerly on the CPU, against the reference model."""

from __future__ import annotations

import pytest
import torch

from mpk.bench.baseline import DecodeLoop, StaticDecoder
from mpk.bench.runner import bench_prompt
from mpk.errors import UnsupportedError
from mpk.models.config import get_preset
from mpk.models.reference import ReferenceModel
from mpk.models.weights import random_weights

PRESETS = ["tiny-qwen3", "tiny-llama"]
MAX_SEQ = 64


def _f32(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in weights.items()}


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_tokens_match_reference(name: str, seed: int) -> None:
    """Prompt fed one token per step, then 8 tokens: the same as the reference's greedy run.

    Both sides run in float32 (weights upcast from the same bf16 values), so the only
    differences are summation order: far below the logit margins of random weights."""
    cfg = get_preset(name)
    weights = random_weights(cfg, seed)
    prompt = bench_prompt(cfg, 1, 7, seed)
    ref = ReferenceModel(cfg, weights, MAX_SEQ, activation_dtype=torch.float32)
    expected = ref.generate_greedy([prompt[0].tolist()], 8)[0]
    model = StaticDecoder(cfg, _f32(weights), MAX_SEQ, batch=1, dtype=torch.float32)
    loop = DecodeLoop(model, prompt, MAX_SEQ)
    loop.prefill()
    assert loop.generate(8)[0].tolist() == expected
    # generate rewinds: a second call gives the same tokens.
    assert loop.generate(8)[0].tolist() == expected


@pytest.mark.parametrize("name", PRESETS)
def test_logits_match_reference(name: str) -> None:
    """Per-step logits, float32 on both sides, at every position of a prompt."""
    cfg = get_preset(name)
    weights = random_weights(cfg, 3)
    prompt = bench_prompt(cfg, 1, 12, 3)
    ref = ReferenceModel(cfg, weights, MAX_SEQ, activation_dtype=torch.float32)
    expected = ref(prompt, 0)[0]                                   # [T, V]
    model = StaticDecoder(cfg, _f32(weights), MAX_SEQ, dtype=torch.float32)
    got = torch.stack([model.logits(prompt[:, t], torch.tensor(t))[0]
                       for t in range(prompt.shape[1])])
    err = (got - expected).norm() / expected.norm()
    assert err < 1e-5, err


@pytest.mark.parametrize("name", PRESETS)
def test_bf16_logits_close_to_reference(name: str) -> None:
    """The benchmark's bf16 mode computes the same function, within bf16 rounding."""
    cfg = get_preset(name)
    weights = random_weights(cfg, 4)
    prompt = bench_prompt(cfg, 1, 10, 4)
    ref = ReferenceModel(cfg, weights, MAX_SEQ, activation_dtype=torch.float32)
    expected = ref(prompt, 0)[0]
    model = StaticDecoder(cfg, weights, MAX_SEQ)                   # bf16
    got = torch.stack([model.logits(prompt[:, t], torch.tensor(t))[0]
                       for t in range(prompt.shape[1])])
    assert got.isfinite().all()
    err = (got - expected).norm() / expected.norm()
    assert err < 3e-2, err


@pytest.mark.parametrize("name", PRESETS)
def test_batched_and_per_row_positions(name: str) -> None:
    """Batch 2 with a shared position ([] tensor) and with per-row positions ([B] tensor)
    give each row the logits it gets alone."""
    cfg = get_preset(name)
    weights = _f32(random_weights(cfg, 5))
    prompt = bench_prompt(cfg, 2, 6, 5)
    singles = []
    for r in range(2):
        m = StaticDecoder(cfg, weights, MAX_SEQ, dtype=torch.float32)
        singles.append(torch.stack([m.logits(prompt[r:r + 1, t], torch.tensor(t))[0]
                                    for t in range(6)]))
    shared = StaticDecoder(cfg, weights, MAX_SEQ, batch=2, dtype=torch.float32)
    per_row = StaticDecoder(cfg, weights, MAX_SEQ, batch=2, dtype=torch.float32)
    for t in range(6):
        a = shared.logits(prompt[:, t], torch.tensor(t))
        b = per_row.logits(prompt[:, t], torch.tensor([t, t]))
        for r in range(2):
            torch.testing.assert_close(a[r], singles[r][t], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(b[r], singles[r][t], rtol=1e-5, atol=1e-5)


def test_per_row_positions_are_independent() -> None:
    """Rows at different positions: row 1 lags row 0 by 2 steps and still matches a solo run."""
    cfg = get_preset("tiny-qwen3")
    weights = _f32(random_weights(cfg, 6))
    prompt = bench_prompt(cfg, 1, 8, 6)[0]
    solo = StaticDecoder(cfg, weights, MAX_SEQ, dtype=torch.float32)
    expected = [solo.logits(prompt[t:t + 1], torch.tensor(t))[0] for t in range(8)]
    pair = StaticDecoder(cfg, weights, MAX_SEQ, batch=2, dtype=torch.float32)
    for t in range(8):
        lag = max(t - 2, 0)  # row 1 repeats position 0 for the first steps (same token: harmless)
        out = pair.logits(torch.stack([prompt[t], prompt[lag]]), torch.tensor([t, lag]))
        torch.testing.assert_close(out[0], expected[t], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[1], expected[lag], rtol=1e-5, atol=1e-5)


def test_forward_is_argmax_of_logits() -> None:
    cfg = get_preset("tiny-llama")
    weights = random_weights(cfg, 7)
    a = StaticDecoder(cfg, weights, MAX_SEQ)
    b = StaticDecoder(cfg, weights, MAX_SEQ)
    tokens = torch.tensor([5])
    for t in range(4):
        pos = torch.tensor(t)
        assert a(tokens, pos).tolist() == b.logits(tokens, pos).argmax(-1).tolist()


def test_rejects_bad_shapes() -> None:
    cfg = get_preset("tiny-qwen3")
    weights = random_weights(cfg, 0)
    with pytest.raises(UnsupportedError, match="batch"):
        StaticDecoder(cfg, weights, MAX_SEQ, batch=1)(torch.tensor([1, 2]), torch.tensor(0))
    with pytest.raises(UnsupportedError, match="max_seq"):
        StaticDecoder(cfg, weights, cfg.max_position + 1)
    loop = DecodeLoop(StaticDecoder(cfg, weights, 8), torch.tensor([[1, 2, 3]]), 8)
    with pytest.raises(UnsupportedError, match="exceeds max_seq"):
        loop.run(6)


@pytest.mark.parametrize("per_row", [False, True])
def test_step_traces_as_one_graph(per_row: bool) -> None:
    """The step compiles with fullgraph=True (no graph breaks, cache writes functionalized) and
    computes what eager does. aot_eager checks the tracing on the CPU without a C++ compiler;
    on a GPU compile_step adds inductor and CUDA graphs on top."""
    torch._dynamo.reset()
    cfg = get_preset("tiny-qwen3")
    weights = _f32(random_weights(cfg, 8))
    prompt = bench_prompt(cfg, 2, 5, 8)
    eager = StaticDecoder(cfg, weights, MAX_SEQ, batch=2, dtype=torch.float32)
    traced = StaticDecoder(cfg, weights, MAX_SEQ, batch=2, dtype=torch.float32)
    compiled = torch.compile(traced, backend="aot_eager", fullgraph=True)
    pos = torch.zeros(2 if per_row else (), dtype=torch.long)
    for t in range(5):
        pos.fill_(t)
        assert compiled(prompt[:, t], pos).tolist() == eager(prompt[:, t], pos).tolist()
    torch.testing.assert_close(traced.layers[1].k_cache, eager.layers[1].k_cache)
