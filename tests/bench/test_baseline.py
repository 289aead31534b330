"""The torch.compile baseline's decoder, run eagerly on the CPU, against the reference model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mpk.bench.baseline import DecodeLoop, StaticDecoder
from mpk.bench.baseline_moe import route
from mpk.bench.runner import bench_prompt
from mpk.errors import UnsupportedError
from mpk.models.config import ModelConfig, get_preset
from mpk.models.reference import ReferenceModel
from mpk.models.weights import random_weights
from mpk.testing import moe_top3_config

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
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_step_traces_as_one_graph(per_row: bool, preset: str) -> None:
    """The step compiles with fullgraph=True (no graph breaks, cache writes functionalized; for
    MoE the router's sort and the expert gather: no data-dependent shapes or host syncs) and
    computes what eager does. aot_eager checks the tracing on the CPU without a C++ compiler;
    on a GPU compile_step adds inductor and CUDA graphs on top."""
    torch._dynamo.reset()
    cfg = get_preset(preset)
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


# ---- Qwen3-MoE -------------------------------------------------------------------------------
#: tiny-qwen3-moe: 6 experts top-2 renormalised, layer 1 dense (mlp_only_layers); top3: 10
#: experts top-3 NOT renormalised, layer 0 dense; step2: decoder_sparse_step 2 (layer 1 sparse).
MOE_CONFIGS = {
    "top2": lambda: get_preset("tiny-qwen3-moe"),
    "top3": moe_top3_config,
    "step2": lambda: dataclasses.replace(get_preset("tiny-qwen3-moe"), name="tiny-moe-step2",
                                         decoder_sparse_step=2, mlp_only_layers=()),
}


def _fp32_tolerance(cfg: ModelConfig, max_seq: int) -> float:
    """Relative logit tolerance between two fp32 implementations of the same function.

    They differ only in summation order: a length-K reduction is off by about sqrt(K) * u
    (u = 2^-24, rounding errors of random sign), and the errors of chained reductions add; a
    layer chains ~10 (q/k/v, the q/k norms, scores, softmax x V, o_proj, the norm, gate/up,
    down, router), then the final norm and lm_head. Summed worst case: ~2e-5 for the tiny
    models. One flipped routing decision or greedy near-tie moves the logits by ~10%."""
    k = max(cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size,
            cfg.num_heads * cfg.head_dim, max_seq)
    return (10 * cfg.num_layers + 2) * math.sqrt(k) * 2.0**-24


@pytest.mark.parametrize("which", sorted(MOE_CONFIGS))
def test_moe_logits_match_reference(which: str) -> None:
    """fp32 logits at every position of a prompt; the layers are MoE or dense as the config
    says (mlp_only_layers, decoder_sparse_step)."""
    cfg = MOE_CONFIGS[which]()
    weights = random_weights(cfg, 3)
    prompt = bench_prompt(cfg, 1, 12, 3)
    ref = ReferenceModel(cfg, weights, MAX_SEQ, activation_dtype=torch.float32)
    expected = ref(prompt, 0)[0]
    model = StaticDecoder(cfg, _f32(weights), MAX_SEQ, dtype=torch.float32)
    assert [layer.moe for layer in model.layers] == \
        [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    assert not all(layer.moe for layer in model.layers)  # a dense layer is covered
    got = torch.stack([model.logits(prompt[:, t], torch.tensor(t))[0]
                       for t in range(prompt.shape[1])])
    err = (got - expected).norm() / expected.norm()
    assert err < _fp32_tolerance(cfg, MAX_SEQ), err


@pytest.mark.parametrize("which", ["top2", "top3"])
@pytest.mark.parametrize("batch", [1, 2])
def test_moe_greedy_tokens_match_reference(which: str, batch: int) -> None:
    """32 greedy tokens after a prompt fed one token per step, each row its own prompt: the
    reference's tokens (it runs the prompts one at a time)."""
    cfg = MOE_CONFIGS[which]()
    weights = random_weights(cfg, 11)
    prompt = bench_prompt(cfg, batch, 8, 11 + batch)
    ref = ReferenceModel(cfg, weights, MAX_SEQ, activation_dtype=torch.float32)
    expected = ref.generate_greedy(prompt.tolist(), 32)
    model = StaticDecoder(cfg, _f32(weights), MAX_SEQ, batch=batch, dtype=torch.float32)
    loop = DecodeLoop(model, prompt, MAX_SEQ)
    loop.prefill()
    assert loop.generate(32).tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_moe_routing_matches_reference_with_ties(dtype: torch.dtype, norm: bool) -> None:
    """The router's ids and weights are the reference's, ties going to the lower expert id:
    experts 1 and 4 tie for first and 0, 2, 3, 5 for third (top-3), also under
    torch.compile(fullgraph=True). Random rows on top must route identically too."""
    cfg = dataclasses.replace(get_preset("tiny-qwen3-moe"), num_experts_per_tok=3,
                              norm_topk_prob=norm)
    weights = random_weights(cfg, 5)
    gate = weights["model.layers.0.mlp.gate.weight"]        # the router [E, H]
    gate[:, 0] = 0.0
    gate[4, 0] = gate[1, 0] = 1.0
    rows = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    rows[:2] = 0.0
    rows[0, 0] = 2.0   # logits [0, 2, 0, 0, 2, 0]; row 1: all experts tie
    rows = rows.to(dtype)
    ref = ReferenceModel(cfg, weights, MAX_SEQ, activation_dtype=dtype)
    want_ids, want_w = ref.route(rows.float(), 0)
    assert want_ids[:2].tolist() == [[1, 4, 0], [0, 1, 2]]
    for fn in (route, torch.compile(route, backend="aot_eager", fullgraph=True)):
        ids, w = fn(rows, gate.to(dtype), cfg.num_experts_per_tok, norm)
        assert ids.tolist() == want_ids.tolist()
        assert w.dtype == dtype
        # fp32: summation order only; bf16: the same rounded values
        torch.testing.assert_close(w.float(), want_w, rtol=0,
                                   atol=1e-6 if dtype == torch.float32 else 0.0)


def test_moe_bf16_shares_stacked_experts_and_stacks_per_expert_tensors() -> None:
    """In bf16 the baseline indexes random_weights' stacked expert buffers in place (no second
    copy of qwen3-30b-a3b's 57 GB next to MPK's); per-expert tensors, as a checkpoint loads
    them, are stacked into the same layout: the same logits, close to the bf16 reference."""
    cfg = get_preset("tiny-qwen3-moe")
    weights = random_weights(cfg, 4)
    shared = StaticDecoder(cfg, weights, MAX_SEQ)
    for i, layer in enumerate(shared.layers):
        if layer.moe:
            p = f"model.layers.{i}.mlp.experts."
            assert layer.experts_gate_up.data_ptr() == weights[p + "0.gate_proj.weight"].data_ptr()
            assert layer.experts_down.data_ptr() == weights[p + "0.down_proj.weight"].data_ptr()
    separate = {k: v.clone() for k, v in weights.items()}
    stacked = StaticDecoder(cfg, separate, MAX_SEQ)
    for a, b in zip(stacked.layers, shared.layers, strict=True):
        if a.moe:
            assert a.experts_gate_up.data_ptr() != b.experts_gate_up.data_ptr()
            assert torch.equal(a.experts_gate_up, b.experts_gate_up)
            assert torch.equal(a.experts_down, b.experts_down)
    prompt = bench_prompt(cfg, 1, 10, 4)
    expected = ReferenceModel(cfg, weights, MAX_SEQ)(prompt, 0)[0]   # bf16 roundings
    for model in (shared, stacked):
        got = torch.stack([model.logits(prompt[:, t], torch.tensor(t))[0] for t in range(10)])
        assert got.isfinite().all()
        err = (got - expected).norm() / expected.norm()
        assert err < 3e-2, err
