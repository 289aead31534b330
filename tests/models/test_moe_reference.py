"""THE ORACLE TEST for mixture of experts: ReferenceModel against transformers'
Qwen3MoeForCausalLM on checkpoints transformers saved itself. Two odd tiny models: 6 experts
top-2 renormalised with a dense layer 1 (the tiny-qwen3-moe preset), and 10 experts top-3 without
renormalisation with a dense layer 0 (mpk.testing.moe_top3_config)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpk.models.config import ModelConfig, get_preset
from mpk.models.reference import ReferenceModel
from mpk.models.weights import load_checkpoint, random_weights
from mpk.testing import moe_top3_config, routing_margins

CONFIGS = {"top2": lambda: get_preset("tiny-qwen3-moe"), "top3": moe_top3_config}
NEW_TOKENS = 16
# bf16 rounding moves logits (router logits too) by about 1% of their spread between two correct
# implementations, so a routing or greedy decision is comparable only when it wins by more
# than that: 5% of the logits' std (as tests/models/test_mpk_vs_transformers.py).
MARGIN = 0.05


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _checkpoint(tmp_path, make_hf_model, cfg: ModelConfig, seed: int):
    """(hf_bf16, hf_fp32, cfg, weights): the model saved by transformers, loaded back by
    transformers (default experts implementation) and by load_checkpoint."""
    path = tmp_path / f"{cfg.name}-{seed}"
    make_hf_model(cfg, seed).save_pretrained(path)
    import transformers

    twins = [transformers.Qwen3MoeForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager").eval()
        for dtype in (torch.bfloat16, torch.float32)]
    loaded, weights = load_checkpoint(path)
    assert loaded == dataclasses.replace(cfg, name=path.name)
    return twins[0], twins[1], loaded, weights


def _tokens(seed: int, batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_fp32_logits_match_transformers(tmp_path, which: str, make_hf_model) -> None:
    seed = 101
    _, hf_fp32, cfg, weights = _checkpoint(tmp_path, make_hf_model, CONFIGS[which](), seed)
    tokens = _tokens(seed, 2, 20, cfg.vocab_size)
    with torch.no_grad():
        expected = hf_fp32(tokens).logits.float()
    ref = ReferenceModel(cfg, weights, max_seq=64, activation_dtype=torch.float32)
    assert _rel_err(ref.forward(tokens, 0), expected) < 1e-4
    ref.reset()  # through the KV cache: a chunk, then one position at a time
    pieces = [ref.forward(tokens[:, :8], 0)]
    pieces += [ref.forward(tokens[:, p:p + 1], p) for p in range(8, 20)]
    assert _rel_err(torch.cat(pieces, dim=1), expected) < 1e-4


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_bf16_logits_match_transformers(tmp_path, which: str, make_hf_model) -> None:
    """hf_exact (HF's roundings, its bf16 kernels and torch.topk) is bit-exact: every rounding
    point of the MoE block, the router's included, is HF's. The plain bf16 mode is within bf16
    tolerance on the first seed whose routing decisions all clear MARGIN (one flipped expert
    moves a position's logits by ~20%, legitimately at a near-tie)."""
    for seed in range(202, 232):
        hf_bf16, _, cfg, weights = _checkpoint(tmp_path, make_hf_model, CONFIGS[which](), seed)
        tokens = _tokens(seed, 1, 12, cfg.vocab_size)
        with torch.no_grad():
            out = hf_bf16(tokens, output_router_logits=True)
        expected = out.logits.float()
        exact = ReferenceModel(cfg, weights, max_seq=64, hf_exact=True)
        assert _rel_err(exact.forward(tokens, 0), expected) < 2e-3, seed
        if routing_margins(out.router_logits, cfg.num_experts_per_tok).min() <= MARGIN:
            continue
        ref = ReferenceModel(cfg, weights, max_seq=64, activation_dtype=torch.bfloat16)
        err = _rel_err(ref.forward(tokens, 0), expected)
        assert err < 2e-2, (seed, err)
        return
    pytest.fail("no seed gave HF routing margins above 5% of the router logits' std")


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_greedy_tokens_match_transformers_generate(tmp_path, which: str,
                                                   make_hf_model) -> None:
    """Identical greedy tokens in fp32, asserted for the first seed whose HF margins (greedy
    and routing) rule out ties."""
    for seed in range(11, 31):
        _, hf_fp32, cfg, weights = _checkpoint(tmp_path, make_hf_model, CONFIGS[which](), seed)
        prompt = _tokens(seed, 1, 5, cfg.vocab_size)[0].tolist()
        ids = torch.tensor([prompt])
        with torch.no_grad():
            seq = hf_fp32.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=NEW_TOKENS)
            out = hf_fp32(seq, output_router_logits=True)
        top = out.logits.float()[0, len(prompt) - 1:-1].topk(2, dim=-1).values
        if bool(((top[:, 0] - top[:, 1]) <= 1e-3).any()) or \
                routing_margins(out.router_logits, cfg.num_experts_per_tok).min() <= 1e-3:
            continue
        ref = ReferenceModel(cfg, weights, max_seq=64, activation_dtype=torch.float32)
        assert ref.generate_greedy([prompt], NEW_TOKENS) == [seq[0, len(prompt):].tolist()]
        return
    pytest.fail("no seed gave HF greedy and routing margins > 1e-3 along the sequence")


def test_routing_ties_renormalisation_and_dense_layers() -> None:
    cfg = dataclasses.replace(get_preset("tiny-qwen3-moe"), num_experts_per_tok=3)
    weights = random_weights(cfg, 5)
    gate = weights["model.layers.0.mlp.gate.weight"]
    gate.zero_()
    gate[4, 0] = gate[1, 0] = 1.0  # experts 1 and 4 tie for first, 0, 2, 3 and 5 for third
    ref = ReferenceModel(cfg, weights, max_seq=8)
    rows = torch.zeros(2, cfg.hidden_size)
    rows[0, 0] = 2.0
    ids, w = ref.route(rows, 0)
    assert ids.tolist() == [[1, 4, 0], [0, 1, 2]]  # equal probabilities: lower expert id first
    probs = torch.softmax(torch.tensor([0.0, 2.0, 0.0, 0.0, 2.0, 0.0]), dim=0)[[1, 4, 0]]
    assert torch.equal(w[0], (probs / probs.sum()).bfloat16().float())  # renormalised, rounded
    assert torch.equal(w[1], torch.full((3,), 1 / 3).bfloat16().float())
    plain = ReferenceModel(dataclasses.replace(cfg, norm_topk_prob=False), weights, max_seq=8)
    _, w = plain.route(rows, 0)
    assert torch.equal(w[0], probs.bfloat16().float())
    with pytest.raises(KeyError):  # layer 1 is dense (mlp_only_layers): it has no router
        ref.route(rows, 1)
