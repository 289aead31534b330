"""CPU proof of tensor parallelism: G=2 ranks, each running its own Plan on the interpreter with
a simulated all-reduce, produce the single-rank Plan's greedy tokens and (within bf16
tolerance) its logits; dropping the cross-rank wait, or reusing a partial buffer too early,
is caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpk.compiler.lower import compile_graph
from mpk.dtypes import DType
from mpk.engine.bind import bind_model
from mpk.errors import MpkError
from mpk.graph.graph import Graph
from mpk.models import builder
from mpk.models.builder import DecodeShape
from mpk.models.config import get_preset
from mpk.models.weights import random_weights
from mpk.parallel import rank_plans
from mpk.tensors import Role
from mpk.testing import CrossRankHazardError, MultiRankCpuExecutor
from tests.interp.model_run import executor, make_plan, run_prompts

SHAPE = DecodeShape(batch=2, steps_per_launch=8, page_size=4, max_pages=8, num_pages=16)
NUM_SMS = 6
NEW_TOKENS = 8
PROMPTS = [[11, 42, 7, 99, 3], [5, 200, 17]]
TOTAL = max(len(p) for p in PROMPTS) - 1 + NEW_TOKENS  # 12 steps: two launches of <= 8
# As tests/models/test_mpk_vs_transformers.py: a greedy decision is only comparable when the
# single-rank top-1 beats its top-2 by more than rounding can move them (5% of the logits' std).
MARGIN = 0.05
LOGITS_TOL = 1e-2


def _stepwise(ex, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step per launch: (tokens_out [steps, B], logits [steps, B, V]) of every step."""
    tokens, logits = [], []
    for g in range(steps):
        forced = torch.full((SHAPE.steps_per_launch, SHAPE.batch), -1, dtype=torch.int32)
        for row, p in enumerate(PROMPTS):
            if g < len(p):
                forced[0, row] = p[g]
        ex.write("prompt", forced)
        ex.write("positions", torch.full((SHAPE.batch,), g, dtype=torch.int32))
        ex.run(1)
        tokens.append(ex.read("tokens_out")[0])
        logits.append(ex.read("logits"))
    return torch.stack(tokens), torch.stack(logits)


def _generated(tokens: torch.Tensor) -> list[list[int]]:
    return [tokens[len(p) - 1: len(p) - 1 + NEW_TOKENS, row].tolist()
            for row, p in enumerate(PROMPTS)]


def _clear_margins(logits: torch.Tensor) -> bool:
    for row, p in enumerate(PROMPTS):
        steps = logits[len(p) - 1: len(p) - 1 + NEW_TOKENS, row]
        top = steps.topk(2, dim=-1).values
        if not bool(((top[:, 0] - top[:, 1]) > MARGIN * steps.std(dim=-1)).all()):
            return False
    return True


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def _single_rank(cfg):
    """The first seed whose single-rank greedy margins are clear: weights + its per-step run."""
    plan = make_plan(cfg, SHAPE, NUM_SMS)
    for seed in range(20):
        weights = random_weights(cfg, seed)
        ex = executor(plan)
        bind_model(ex, ex.plan, cfg, SHAPE, weights, seed)
        tokens, logits = _stepwise(ex, TOTAL)
        if _clear_margins(logits):
            return seed, weights, ex, tokens, logits
    pytest.fail("no seed gave single-rank greedy margins above 5% of the logits' std")


def _ranks(cfg, weights_seed: int, weights, **opts):
    ex = MultiRankCpuExecutor(rank_plans(cfg, SHAPE, 2, NUM_SMS), **opts)
    full = ex.as_executor()
    # The same binding as the single-rank run: full weights, KV noise and page table, sharded.
    bind_model(full, full.plan, cfg, SHAPE, weights, weights_seed)
    return ex, full


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_two_ranks_equal_the_single_rank_plan(preset: str) -> None:
    cfg = get_preset(preset)
    seed, weights, single, tokens, logits = _single_rank(cfg)
    want = _generated(tokens)
    # Multi-step launches, rank 0 racing ahead as far as the cross-rank waits let it.
    _, full = _ranks(cfg, seed, weights, order="schedule")
    assert run_prompts(full, SHAPE, PROMPTS, NEW_TOKENS) == want, f"seed {seed}"
    assert _rel(full.read("logits"), logits[-1]) < LOGITS_TOL  # read() also checks ranks agree
    # The single-rank plan through the same scheduler: the same pages hold the same positions.
    single = executor(make_plan(cfg, SHAPE, NUM_SMS))
    bind_model(single, single.plan, cfg, SHAPE, weights, seed)
    assert run_prompts(single, SHAPE, PROMPTS, NEW_TOKENS) == want
    for name in ("k_cache.0", "v_cache.1"):  # each rank's KV heads, gathered
        assert _rel(full.read(name).float(), single.read(name).float()) < LOGITS_TOL, name
    with pytest.raises(MpkError, match="rank-local"):  # each rank's own partial sum
        full.read("layers.0.attn_partial")
    # One step per launch in a random interleaving: every step's logits, identical on both ranks.
    _, full = _ranks(cfg, seed, weights, order="random", seed=seed)
    got_tokens, got_logits = _stepwise(full, TOTAL)
    assert _generated(got_tokens) == want, f"seed {seed}"
    for g in range(len(PROMPTS[1]) - 1, TOTAL):
        assert _rel(got_logits[g], logits[g]) < LOGITS_TOL, f"step {g}, seed {seed}"


def test_one_rank_tp_plan_equals_the_single_rank_plan() -> None:
    """TP size 1 (partials + a one-rank allreduce) is the same model, bit for bit in tokens."""
    cfg = get_preset("tiny-llama")
    seed, weights, _, tokens, _ = _single_rank(cfg)
    full = MultiRankCpuExecutor(rank_plans(cfg, SHAPE, 1, NUM_SMS)).as_executor()
    bind_model(full, full.plan, cfg, SHAPE, weights, seed)
    # Driven by the engine's own scheduler: the Executor protocol is all it needs.
    got = run_prompts(full, SHAPE, PROMPTS, NEW_TOKENS)
    assert got == _generated(tokens)


def test_dropping_the_cross_rank_wait_is_caught() -> None:
    """Without the simulated all-reduce wait, rank 0 (scheduled first) sums rank 1's partials
    before rank 1 wrote them: the poisoned (NaN) buffers reach its logits."""
    cfg = get_preset("tiny-qwen3")
    weights = random_weights(cfg, 1)
    for wait in (True, False):
        ex, full = _ranks(cfg, 1, weights, order="schedule", cross_rank_wait=wait)
        full.write("prompt", torch.full((SHAPE.steps_per_launch, SHAPE.batch), 3,
                                        dtype=torch.int32))
        full.run(2)
        poisoned = bool(torch.isnan(ex.read(0, "logits")).any())
        assert poisoned == (not wait)


def _no_chain_plan():
    """A partial whose producer does not depend on the previous all-reduce (x is an input), so
    nothing stops a rank from overwriting it before a slow peer has read it."""
    g = Graph()
    g.add_tensor("x", (2, 16), DType.BF16, Role.IO)
    g.add_tensor("w", (32, 16), DType.BF16, Role.WEIGHT)
    g.add_tensor("part", (2, 32), DType.F32, Role.ACTIVATION)
    g.add_tensor("out", (2, 32), DType.BF16, Role.IO)
    g.add_op("linear", "proj", (2,), {"x": "x", "weight": "w", "out": "part"})
    g.add_op("allreduce", "reduce", (2,), {"partial": "part", "out": "out"}, ranks=2)
    return compile_graph(g, 2)


def test_partial_reuse_before_peers_read_it_is_caught() -> None:
    """The model needs no write-after-read wait across ranks only because of the hidden-state
    chain; the simulator checks that on every all-reduce. A graph without the chain trips it."""
    plan = _no_chain_plan()
    caught = 0
    for seed in range(8):
        ex = MultiRankCpuExecutor([plan, plan], order="random", seed=seed)
        for r in range(2):
            ex.bind(r, "x", torch.randn(2, 16).bfloat16())
            ex.bind(r, "w", torch.randn(32, 16).bfloat16())
            ex.bind(r, "out", torch.zeros(2, 32, dtype=torch.bfloat16))
        try:
            ex.run(4)
        except CrossRankHazardError as e:
            assert "double buffering" in str(e)
            caught += 1
    assert caught > 0


def test_rank_plans_must_agree() -> None:
    cfg = get_preset("tiny-llama")
    plans = rank_plans(cfg, SHAPE, 2, NUM_SMS)
    single = make_plan(cfg, SHAPE, NUM_SMS)
    with pytest.raises(MpkError, match="different allreduce ops"):
        MultiRankCpuExecutor([plans[0], single])
    ex = MultiRankCpuExecutor(plans)
    with pytest.raises(MpkError, match="bind these tensors"):
        ex.run(1)
    with pytest.raises(MpkError, match="rank 2"):
        ex.read(2, "logits")


def test_two_ranks_with_kv_splits_equal_the_single_rank_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape for long contexts splits each rank's attention (its last split merges: arrival
    counters, Tile.arrive on every rank); tokens equal the single-rank plan's. At 4 positions
    a split, a row uses three splits from its 9th position on."""
    cfg = get_preset("tiny-qwen3")
    seed, weights, _, tokens, _ = _single_rank(cfg)
    monkeypatch.setattr(builder, "SPLIT_POSITIONS", 4)
    long = dataclasses.replace(SHAPE, page_size=16, max_pages=32, num_pages=64)
    plans = rank_plans(cfg, long, 2, NUM_SMS)
    assert all(op.grid[2] > 1 for plan in plans for op in plan.ops if op.kind == "attention")
    full = MultiRankCpuExecutor(plans, order="random", seed=seed).as_executor()
    bind_model(full, full.plan, cfg, long, weights, seed)
    assert run_prompts(full, long, PROMPTS, NEW_TOKENS) == _generated(tokens), f"seed {seed}"
