"""Shared helpers for the model tests: Hugging Face twins of our configs and models."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mpk.models.config import ModelConfig
from mpk.models.weights import random_weights


def hf_config(cfg: ModelConfig) -> Any:
    """transformers' Qwen3Config / LlamaConfig for cfg (eager attention, no eos/pad)."""
    transformers = pytest.importorskip("transformers")
    cls = transformers.Qwen3Config if cfg.arch == "qwen3" else transformers.LlamaConfig
    return cls(**cfg.to_hf(), attn_implementation="eager")


def hf_model(cfg: ModelConfig, seed: int) -> Any:
    """A bf16 Hugging Face model of cfg holding random_weights(cfg, seed).

    Loading our weights (rather than HF's std-0.02 init) gives O(1) activations, which makes
    the comparison sharper, and checks that our tensor names are exactly HF's."""
    transformers = pytest.importorskip("transformers")
    cls = (transformers.Qwen3ForCausalLM if cfg.arch == "qwen3"
           else transformers.LlamaForCausalLM)
    torch.manual_seed(seed)
    model = cls(hf_config(cfg)).to(torch.bfloat16).eval()
    weights = random_weights(cfg, seed)
    result = model.load_state_dict(weights, strict=False)
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
