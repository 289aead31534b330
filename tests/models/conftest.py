"""Shared helpers for the model tests: Hugging Face twins of our configs and models."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mpk.models.config import ModelConfig
from mpk.models.weights import random_weights


_HF_CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "llama": ("LlamaConfig", "LlamaForCausalLM"),
               "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}


def hf_config(cfg: ModelConfig) -> Any:
    """transformers' Qwen3Config / LlamaConfig / Qwen3MoeConfig for cfg (eager attention, no
    eos/pad)."""
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, _HF_CLASSES[cfg.arch][0])
    return cls(**cfg.to_hf(), attn_implementation="eager")


def hf_state_dict(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our HF-checkpoint-named weights as transformers' modules hold them: its Qwen3-MoE keeps
    each layer's experts fused (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])
    and converts from / to the per-expert checkpoint names in from_pretrained / save_pretrained."""
    out = dict(weights)
    for layer in range(cfg.num_layers):
        if not cfg.is_moe_layer(layer):
            continue
        p = f"model.layers.{layer}.mlp.experts."
        parts = {kind: [out.pop(f"{p}{e}.{kind}_proj.weight") for e in range(cfg.num_experts)]
                 for kind in ("gate", "up", "down")}
        out[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in
                                               zip(parts["gate"], parts["up"])])
        out[p + "down_proj"] = torch.stack(parts["down"])
    return out


def hf_model(cfg: ModelConfig, seed: int) -> Any:
    """A bf16 Hugging Face model of cfg holding random_weights(cfg, seed).

    Loading our weights (rather than HF's std-0.02 init) gives O(1) activations, which makes
    the comparison sharper, and checks that our tensor names are exactly HF's."""
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, _HF_CLASSES[cfg.arch][1])
    torch.manual_seed(seed)
    model = cls(hf_config(cfg)).to(torch.bfloat16).eval()
    weights = random_weights(cfg, seed)
    result = model.load_state_dict(hf_state_dict(cfg, weights), strict=False)
    allowed_missing = {"lm_head.weight"} if cfg.tie_embeddings else set()
    assert set(result.missing_keys) <= allowed_missing, result.missing_keys
    assert not result.unexpected_keys, result.unexpected_keys
    if cfg.tie_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.fixture
def make_hf_config():
    """hf_config as a fixture (fixtures work in every pytest import mode; imports of conftest
    do not)."""
    return hf_config


@pytest.fixture
def make_hf_model():
    """hf_model as a fixture."""
    return hf_model
