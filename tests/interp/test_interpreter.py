"""Interpreter vs the independent PyTorch reference model (correctness gate 2 and 3)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpk.compiler import record
from mpk.engine.bind import bind_model
from mpk.models import builder
from mpk.models.builder import DecodeShape
from mpk.models.config import get_preset
from mpk.models.reference import ReferenceModel
from mpk.models.weights import random_weights
from mpk.testing import greedy_mismatches
from tests.interp.model_run import executor, make_plan, run_prompts

SEED = 20261201  # fixed: CI is deterministic (vary it by hand to sweep)

SHAPE = DecodeShape(batch=3, steps_per_launch=4, page_size=4, max_pages=8, num_pages=32)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama", "tiny-qwen3-moe"])
@pytest.mark.parametrize("order", ["schedule", "random", "free"])
def test_tokens_match_reference(preset: str, order: str) -> None:
    cfg = get_preset(preset)
    seed = SEED
    weights = random_weights(cfg, seed=seed)
    prompts = [[1, 5, 9, 3], [7, 2], [4, 4, 4, 4, 4, 1]]
    ex = executor(make_plan(cfg, SHAPE, num_sms=6), order=order, seed=seed)
    bind_model(ex, ex.plan, cfg, SHAPE, weights, seed)
    got = run_prompts(ex, SHAPE, prompts, new_tokens=10)
    bad = greedy_mismatches(ReferenceModel(cfg, weights, max_seq=64), prompts, got)
    assert not bad, f"seed {seed}: " + "; ".join(bad)


@pytest.mark.parametrize("preset,head_dim", [("tiny-qwen3", None), ("tiny-llama", None),
                                             ("tiny-llama", 80), ("tiny-qwen3", 16),
                                             ("tiny-qwen3", 256)])
def test_logits_match_reference(preset: str, head_dim: int | None) -> None:
    """Any head_dim that is a multiple of 16 up to 256 (the kinds' limit), not only 64 / 128."""
    cfg = get_preset(preset)
    if head_dim is not None:
        cfg = dataclasses.replace(cfg, head_dim=head_dim, name=f"{preset}-d{head_dim}")
    seed = SEED
    weights = random_weights(cfg, seed=seed)
    shape = DecodeShape(batch=1, steps_per_launch=4, page_size=4, max_pages=8, num_pages=8)
    ex = executor(make_plan(cfg, shape, num_sms=5))
    bind_model(ex, ex.plan, cfg, shape, weights, seed)
    prompt = [3, 1, 4, 1]
    ex.write("prompt", torch.tensor(prompt, dtype=torch.int32)[:, None])
    ex.run(1)
    logits = ex.read("logits")[0]
    ref = ReferenceModel(cfg, weights, max_seq=32).forward(torch.tensor([prompt[:1]]), 0)[0, -1]
    err = (logits - ref).norm() / ref.norm()
    assert err < 1e-2, f"relative error {err:.3g} (seed {seed})"


def test_long_context_plan_splits_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long KV cache splits attention (partials, merged by the split that arrives last, in
    the random order's sequence of tasks); tokens still match the reference. At 4 positions a
    split the rows use one split up to 8 positions and three from 9 (effective_splits): both
    paths, and rows whose split count changes between steps."""
    monkeypatch.setattr(builder, "SPLIT_POSITIONS", 4)
    cfg = get_preset("tiny-llama")
    seed = SEED
    weights = random_weights(cfg, seed=seed)
    shape = DecodeShape(batch=2, steps_per_launch=8, page_size=16, max_pages=64, num_pages=128)
    plan = make_plan(cfg, shape, num_sms=16)
    assert {op.grid[2] for op in plan.ops if op.kind == "attention"} == {4}
    first = plan.op_params[:, record.ARRIVALS_PARAM]
    assert (first >= 0).sum() == cfg.num_layers
    ex = executor(plan, order="random", seed=seed)
    bind_model(ex, ex.plan, cfg, shape, weights, seed)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    got = run_prompts(ex, shape, prompts, new_tokens=6)
    bad = greedy_mismatches(ReferenceModel(cfg, weights, max_seq=64), prompts, got)
    assert not bad, f"seed {seed}: " + "; ".join(bad)
    # Row 0 reached 9-10 positions (two steps of merges), row 1 at most 8 (one split).
    counters = ex.counters.value[int(first[first >= 0].min()):].reshape(cfg.num_layers, 2, -1)
    assert (counters[:, 0] == 2 * 4).all() and (counters[:, 1] == 0).all()


def test_fused_and_unfused_plans_agree() -> None:
    """A fused rmsnorm prologue folds the norm weight into the linear's weight (its rounding
    moves: tasks/linear/task.py), so each plan is held to the reference that rounds as it does,
    bit for bit, and the two to each other up to bf16 rounding."""
    cfg = get_preset("tiny-qwen3")
    seed = SEED
    weights = random_weights(cfg, seed=seed)
    shape = DecodeShape(batch=2, steps_per_launch=3, page_size=4, max_pages=4, num_pages=8)
    prompt = torch.tensor([[1, 2], [3, 4], [-1, -1]], dtype=torch.int32)
    results = []
    for fuse_ops in (True, False):
        plan = make_plan(cfg, shape, num_sms=4, fuse_ops=fuse_ops)
        ex = executor(plan, order="free", seed=seed)
        bind_model(ex, ex.plan, cfg, shape, weights, seed)
        ex.write("prompt", prompt)
        ex.run(3)
        kinds = {op.kind for op in plan.ops}
        assert ("rmsnorm" in kinds) == (not fuse_ops)
        # Rows 0 and 1 take prompts (1, 3) and (2, 4), then the token step 1 chose.
        ref = ReferenceModel(cfg, weights, max_seq=8, fused_norms=fuse_ops)
        ref.forward(prompt[:2].T.long(), 0)
        want = ref.forward(ex.read("tokens_out")[1, :, None].long(), 2)[:, -1]
        logits = ex.read("logits")
        assert torch.equal(logits, want), f"fuse_ops={fuse_ops}"
        results.append(logits)
    err = float((results[0] - results[1]).norm() / results[1].norm())
    assert 0 < err < 1e-2


def test_unwritten_activation_is_poisoned() -> None:
    cfg = get_preset("tiny-llama")
    shape = DecodeShape(batch=1, steps_per_launch=2, page_size=4, max_pages=4, num_pages=4)
    ex = executor(make_plan(cfg, shape, num_sms=3))
    assert torch.isnan(ex.read("logits")).all()
    assert (ex.read("tokens") < -1_000_000).all()


@pytest.mark.parametrize("head_dim", [72, 272])
def test_unsupported_head_dim_is_refused_by_name(head_dim: int) -> None:
    from mpk.errors import GraphError
    from mpk.models.builder import build_graph

    cfg = dataclasses.replace(get_preset("tiny-llama"), head_dim=head_dim)
    with pytest.raises(GraphError, match=f"head_dim {head_dim} is not supported"):
        build_graph(cfg, SHAPE, num_sms=4)
