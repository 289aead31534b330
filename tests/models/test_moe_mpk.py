"""MPK (graph -> Plan -> CPU interpreter) on Qwen3-MoE against transformers' Qwen3MoeForCausalLM,
on checkpoints transformers saved itself: the same greedy tokens as `generate` for both rows of a
batch-2 decode (rows that choose different experts in the same step), on the two tiny MoE models
of tests/models/test_moe_reference.py (6 experts top-2 renormalised with a dense layer, 10
experts top-3 without renormalisation). The same on CUDA through the Engine (the megakernel's
moe_router / moe_gate_up / moe_down against transformers, issue 12's GPU check)."""

from __future__ import annotations

import pytest
import torch

from mpk.models.config import ModelConfig, get_preset
from mpk.models.weights import load_checkpoint
from mpk.testing import moe_top3_config, routing_margins
from tests.interp.model_run import run_prompts
from tests.models.test_mpk_vs_transformers import SHAPE, _mpk

CONFIGS = {"top2": lambda: get_preset("tiny-qwen3-moe"), "top3": moe_top3_config}
NEW_TOKENS = 8
# Fixed seed (CI is deterministic), chosen by a sweep of seeds 100-115 as one whose HF decisions
# clear the margins below on both models. HF rounds its logits to bf16, so greedy margins come
# in steps of ~1.5% of the logits' std (one bf16 ulp apart = a true near-tie); routing
# decisions along 2 MoE layers x 11 positions x 2 prompts are rarely > 5% apart on random
# weights, so the routing guard is 1%. Where the sweep saw MPK differ from HF, margins were at
# such ties (on seed 40, checked by hand, MPK equals the bf16 ReferenceModel and differs from
# HF exactly where the reference does).
SEED = 111
# Fixed, tried in order: another machine's torch (the GPU machine's 2.11) draws other random
# checkpoints from the same seed, and there seed 111's top-3 model rests on a near-tie (greedy
# margin 0.016, routing 0.004; seventh session); 101 is clear there. CI's CPU torch takes 111.
SEEDS = (SEED, 101)
GREEDY_MARGIN = 0.02
ROUTING_MARGIN = 0.01


def _saved(tmp_path, make_hf_model, cfg: ModelConfig, seed: int):
    import transformers

    path = tmp_path / f"{cfg.name}-{seed}"
    make_hf_model(cfg, seed).save_pretrained(path)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                          attn_implementation="eager")
    loaded, weights = load_checkpoint(path)
    return hf.eval(), loaded, weights


def _hf_greedy(hf, cfg: ModelConfig, prompt: list[int]) -> tuple[list[int], float, float]:
    """HF generate's new tokens, the smallest greedy margin and the smallest routing margin
    along the sequence (in units of the logits' std)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=NEW_TOKENS)
        out = hf(seq, output_router_logits=True)
    logits = out.logits.float()[0, len(prompt) - 1:-1]
    top = logits.topk(2, dim=-1).values
    greedy = float(((top[:, 0] - top[:, 1]) / logits.std(dim=-1)).min())
    routing = float(routing_margins(out.router_logits, cfg.num_experts_per_tok).min())
    return seq[0, len(prompt):].tolist(), greedy, routing


def _clear_case(tmp_path, make_hf_model, which: str, seed: int):
    """The checkpoint of `seed`, its two prompts and transformers' greedy tokens for them, or
    None when its decisions rest on a near-tie (the comparison would be ill-posed)."""
    hf, cfg, weights = _saved(tmp_path, make_hf_model, CONFIGS[which](), seed)
    assert (cfg.num_experts, cfg.mlp_only_layers) == (CONFIGS[which]().num_experts,
                                                      CONFIGS[which]().mlp_only_layers)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in (4, 3)]
    expected = []
    for prompt in prompts:
        tokens, greedy, routing = _hf_greedy(hf, cfg, prompt)
        if greedy <= GREEDY_MARGIN or routing <= ROUTING_MARGIN:
            return None
        expected.append(tokens)
    return cfg, weights, prompts, expected


def _expected(tmp_path, make_hf_model, which: str, seeds: tuple[int, ...]):
    """The case of the first of `seeds` whose transformers decisions clear the margins."""
    for seed in seeds:
        case = _clear_case(tmp_path, make_hf_model, which, seed)
        if case is not None:
            return seed, case
    raise AssertionError(f"seeds {seeds} all rest on near-ties: transformers or torch changed; "
                         f"pick other seeds")


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_greedy_tokens_equal_generate(tmp_path, which: str, make_hf_model) -> None:
    seed, (cfg, weights, prompts, expected) = _expected(tmp_path, make_hf_model, which, SEEDS)
    got = run_prompts(_mpk(cfg, weights, seed), SHAPE, prompts, NEW_TOKENS)
    assert got == expected, f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_greedy_tokens_equal_generate_on_cuda(tmp_path, which: str, make_hf_model) -> None:
    """Both prompts in one batch of the CUDA engine (rows choosing different experts in one
    step, as on the CPU), from the first clear one of SEEDS (101 on the GPU machine)."""
    from mpk.engine.engine import Engine

    seed, (cfg, weights, prompts, expected) = _expected(tmp_path, make_hf_model, which, SEEDS)
    engine = Engine(cfg, weights, backend="cuda", progress=False)
    got = engine.generate(prompts, NEW_TOKENS).token_ids
    assert got == expected, f"seed {seed}"


def test_graph_weights_reuse_stacked_experts() -> None:
    """random_weights lays each MoE layer's experts out stacked as the graph reads them, so
    graph_weights takes those buffers without a second copy; separate expert tensors (a loaded
    checkpoint) are stacked into the same layout."""
    from mpk.models.builder import graph_weights
    from mpk.models.weights import random_weights

    cfg = get_preset("tiny-qwen3-moe")
    hf = random_weights(cfg, 3)
    p = "model.layers.0.mlp.experts."
    out = graph_weights(cfg, hf, 64)
    assert out["layers.0.experts_gate_up"].data_ptr() == hf[p + "0.gate_proj.weight"].data_ptr()
    assert out["layers.0.experts_down"].data_ptr() == hf[p + "0.down_proj.weight"].data_ptr()
    assert "layers.1.gate_up_weight" in out and "layers.1.router_weight" not in out  # dense
    copies = graph_weights(cfg, {k: v.clone() for k, v in hf.items()}, 64)
    for name in ("layers.0.experts_gate_up", "layers.0.experts_down", "layers.2.router_weight"):
        assert torch.equal(copies[name], out[name])
    assert torch.equal(out["layers.2.experts_gate_up"][4, 1], hf["model.layers.2.mlp.experts.4."
                                                                  "up_proj.weight"])
