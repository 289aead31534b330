"""Sampling in lm_head's epilogue (Gumbel-max with a counter-based generator): the token
frequencies of many positions match softmax(logits / T), a seed reproduces its tokens, and
temperature 0 stays exactly greedy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpk.backends.registry import create_executor
from mpk.compiler.lower import compile_graph
from mpk.models import decode_io as io
from mpk.tasks.sampling import (RowSampling, encode, kept_threshold, ordered_keys,
                                sample_filtered, uniform)
from mpk.testing import sampling_head_graph

VOCAB, K, STEPS, TASKS = 64, 16, 4000, 5
LOGITS = torch.linspace(-2.0, 2.0, VOCAB)  # a spread of probabilities, every token reachable


def test_uniform_is_a_fixed_function_in_the_open_interval() -> None:
    u = uniform(7, 3, np.arange(50000))
    assert 0 < u.min() and u.max() < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert np.array_equal(u, uniform(7, 3, np.arange(50000)))
    assert not np.array_equal(u, uniform(8, 3, np.arange(50000)))
    assert not np.array_equal(u, uniform(7, 4, np.arange(50000)))


def _run(rows: list[tuple[float, int, int, float]], steps: int = STEPS) -> torch.Tensor:
    """tokens_out [steps, rows] for per-row (temperature, seed, top_k, top_p), positions
    0 .. steps-1. x @ W^T = LOGITS for every row (W's column 0 holds the logits, x = e_0)."""
    batch = len(rows)
    graph = sampling_head_graph(batch, VOCAB, K, TASKS, steps)
    ex = create_executor(compile_graph(graph, num_sms=3), "cpu")
    x = torch.zeros(batch, K, dtype=torch.bfloat16)
    x[:, 0] = 1
    w = torch.zeros(VOCAB, K)
    w[:, 0] = LOGITS
    words = torch.tensor([encode(*row) for row in rows], dtype=torch.int32)
    ex.bind("x", x)
    ex.bind("w", w.bfloat16())
    ex.bind(io.SAMPLING, words)
    ex.bind(io.POSITIONS, torch.zeros(batch, dtype=torch.int32))
    ex.bind("tokens_out", torch.zeros(steps, batch, dtype=torch.int32))
    ex.run(steps)
    return ex.read("tokens_out")


def _chi2(tokens: torch.Tensor, expected: np.ndarray) -> float:
    """Pearson's chi-square of the token counts against `expected` probabilities (its support)."""
    counts = np.bincount(tokens.numpy(), minlength=VOCAB)
    assert counts[expected == 0].sum() == 0, "a token outside the support was drawn"
    e = STEPS * expected[expected > 0]
    return float((((counts[expected > 0] - e) ** 2) / e).sum())


def test_frequencies_match_softmax_and_greedy_stays_greedy() -> None:
    out = _run([(0.8, 12345, 0, 1.0), (0.0, 99, 0, 1.0), (0.8, 12345, 0, 1.0),
                (0.8, 777, 0, 1.0)])
    logits = LOGITS.bfloat16().float()  # the weights are bf16
    expected = torch.softmax(logits / 0.8, dim=0).numpy()
    counts = np.bincount(out[:, 0].numpy(), minlength=VOCAB)
    chi2 = float((((counts - STEPS * expected) ** 2) / (STEPS * expected)).sum())
    # 63 degrees of freedom: the 99.9% quantile of chi-square is ~104 (a fixed seed: no flakes;
    # a wrong temperature or a biased generator lands in the thousands).
    assert chi2 < 104, chi2
    assert bool((out[:, 1] == int(torch.argmax(logits))).all())  # temperature 0: argmax
    assert torch.equal(out[:, 0], out[:, 2])  # same seed, same positions: same tokens
    assert not torch.equal(out[:, 0], out[:, 3])  # another seed: other tokens
    wrong = torch.softmax(logits / 1.6, dim=0).numpy()  # the test can tell temperatures apart
    chi2_wrong = float((((counts - STEPS * wrong) ** 2) / (STEPS * wrong)).sum())
    assert chi2_wrong > 10 * 104, chi2_wrong


@pytest.mark.parametrize("temperature", [1e-4])
def test_a_tiny_temperature_is_greedy(temperature: float) -> None:
    out = _run([(temperature, 5, 0, 1.0)], steps=300)
    assert bool((out[:, 0] == int(torch.argmax(LOGITS.bfloat16().float()))).all())
    assert math.isfinite(temperature)


def _chi2_limit(dof: int) -> float:
    """The 99.9% quantile of chi-square with `dof` degrees of freedom (Wilson-Hilferty; within
    1% of the exact value for dof >= 3)."""
    a = 2 / (9 * dof)
    return dof * (1 - a + 3.0902 * math.sqrt(a)) ** 3


def _filtered_probs(temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """softmax(LOGITS / T) restricted as top-k then top-p define it, in float64 and by sorting
    (independent of the kernel's fixed-point radix selection; LOGITS has no ties)."""
    probs = torch.softmax(LOGITS.bfloat16().double() / temperature, dim=0).numpy()
    order = np.argsort(-probs, kind="stable")
    keep = order[:top_k] if top_k else order
    p = probs[keep] / probs[keep].sum()
    cum = np.cumsum(p)
    n = int(np.searchsorted(cum, top_p - 1e-12)) + 1
    if n < len(keep):  # the test's p must not sit on a boundary that rounding could move
        assert min(abs(cum[n - 1] - top_p), abs(cum[n - 2] - top_p) if n > 1 else 1) > 1e-4
    out = np.zeros(VOCAB)
    out[keep[:n]] = p[:n] / p[:n].sum()
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 8, 1.0), (1.0, 0, 0.5),
                                                     (0.9, 20, 0.7)])
def test_filtered_frequencies_match_the_restricted_softmax(temperature: float, top_k: int,
                                                           top_p: float) -> None:
    out = _run([(temperature, 31, top_k, top_p)])
    expected = _filtered_probs(temperature, top_k, top_p)
    support = int((expected > 0).sum())
    assert 1 < support < VOCAB
    chi2 = _chi2(out[:, 0], expected)
    assert chi2 < _chi2_limit(support - 1), (chi2, support)
    # The test tells the filter apart from the unfiltered distribution (which also draws
    # tokens outside the support: _chi2 would refuse those).
    plain = torch.softmax(LOGITS.bfloat16().double() / temperature, dim=0).numpy()
    assert plain[expected == 0].sum() * STEPS > 50


def test_a_filtered_row_is_reproducible_whatever_runs_beside_it() -> None:
    row = (0.8, 12345, 8, 0.9)
    alone = _run([row], steps=200)[:, 0]
    beside = _run([(0.0, 1, 0, 1.0), row, (1.2, 5, 3, 1.0)], steps=200)
    assert torch.equal(alone, beside[:, 1])
    assert bool((beside[:, 0] == int(torch.argmax(LOGITS.bfloat16().float()))).all())
    assert set(beside[:, 2].tolist()) <= {VOCAB - 1, VOCAB - 2, VOCAB - 3}


def test_ties_at_the_threshold_are_kept() -> None:
    logits = np.array([1.0, 3.0, 3.0, 2.0, 3.0, 0.0, -0.0], dtype=np.float32)
    keys = ordered_keys(logits)
    assert keys[5] == keys[6]  # -0 orders as +0
    row = RowSampling.decode(list(encode(1.0, 0, top_k=2)))
    assert np.array_equal(keys >= kept_threshold(logits, row), logits == 3)  # all three 3s
    row = RowSampling.decode(list(encode(1.0, 0, top_k=4)))
    assert np.array_equal(keys >= kept_threshold(logits, row), logits >= 2)
    # top_p: the three 3s hold 3e^3 / (3e^3 + e^2 + e + 2) = 0.87 of the mass
    row = RowSampling.decode(list(encode(1.0, 0, top_p=0.5)))
    assert np.array_equal(keys >= kept_threshold(logits, row), logits == 3)
    row = RowSampling.decode(list(encode(1.0, 0, top_p=0.9)))
    assert np.array_equal(keys >= kept_threshold(logits, row), logits >= 2)


def test_sampling_words() -> None:
    assert encode(0.0, 7, 5, 0.5) == (0, 0, 0, 0, 0)  # greedy: filters do not matter
    row = RowSampling.decode(list(encode(0.5, 2**40 + 3, 7, 0.25)))
    assert (row.temperature, row.seed, row.top_k, row.top_p_fixed) == (0.5, 2**40 + 3, 7, 1 << 22)
    assert row.filters
    assert not RowSampling.decode(list(encode(0.5, 1, 0, 1.0))).filters  # plain temperature
    assert RowSampling.decode(list(encode(0.5, 1, 0, 1e-9))).top_p_fixed == 1  # never empty


@pytest.mark.parametrize("logits,temperature,top_k,top_p,kept", [
    ([1.0, 2.0, math.nan, 3.0, math.nan], 1.0, 2, 0.5, [2, 4]),  # NaN ranks highest
    ([1.0, math.inf, 2.0, math.inf], 1.0, 2, 0.5, [1, 3]),  # inf - inf: no mass, top-k stays
    ([4.0, 5.0, 0.01], 1e-40, 1, 0.5, [1]),  # l / T overflows: top-k stays
    ([4.0, 5.0, 0.01], 1e-40, 0, 0.5, [0, 1, 2]),
])
def test_non_finite_scores_keep_the_top_k_set(logits: list[float], temperature: float,
                                              top_k: int, top_p: float, kept: list[int]) -> None:
    """What the kernel does when top / T is not finite (every mass 0): no nucleus, top-k only
    (the review's reproducers; the interpreter used to raise here)."""
    values = np.array(logits, dtype=np.float32)
    row = RowSampling.decode(list(encode(temperature, 3, top_k, top_p)))
    assert np.flatnonzero(ordered_keys(values) >= kept_threshold(values, row)).tolist() == kept


def test_the_draw_never_leaves_the_kept_set() -> None:
    """All kept scores -inf after scaling: still a kept token (torch.argmax over a masked row
    would say 0)."""
    row = RowSampling.decode(list(encode(1e-10, 3, top_k=1)))
    assert sample_filtered(torch.tensor([-2e30, -1e30]), row, 0) == 1


def test_out_of_range_nucleus_words_mean_no_nucleus() -> None:
    words = list(encode(1.0, 3, top_p=0.5))
    for p in (1 << 24, (1 << 24) + 5, -3):
        words[4] = p
        assert RowSampling.decode(words).top_p_fixed == 0


def test_a_run_row_draws_at_its_own_position() -> None:
    """A row of a 3-row run moves 3 positions a step (tasks/runs.py), so its draw at step s is
    the draw of a row alone at step 3s: the noise follows the position, not the step."""
    steps, batch = 12, 2
    graph = sampling_head_graph(batch, VOCAB, K, TASKS, steps, runs=True)
    ex = create_executor(compile_graph(graph, num_sms=3), "cpu")
    x = torch.zeros(batch, K, dtype=torch.bfloat16)
    x[:, 0] = 1
    w = torch.zeros(VOCAB, K)
    w[:, 0] = LOGITS
    for name, value in {"x": x, "w": w.bfloat16(),
                        io.SAMPLING: torch.tensor([encode(1.0, 77, 20, 0.9)] * batch,
                                                  dtype=torch.int32),
                        io.POSITIONS: torch.tensor([5, 5], dtype=torch.int32),
                        io.RUNS: torch.tensor([[2, 3], [0, 1]], dtype=torch.int32),
                        "tokens_out": torch.zeros(steps, batch, dtype=torch.int32)}.items():
        ex.bind(name, value)
    ex.run(steps)
    out = ex.read("tokens_out")
    assert torch.equal(out[:4, 0], out[0:12:3, 1])
    assert not torch.equal(out[:4, 0], out[:4, 1])  # the positions differ, so do the draws
