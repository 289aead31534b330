"""rope_table against transformers' rotary embedding modules (plain RoPE and llama3 scaling)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpk.models.config import get_preset
from mpk.models.rope import inv_freq, rope_table

NAMES = ["tiny-qwen3", "tiny-llama", "qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b"]


def _hf_rotary(cfg, make_hf_config):
    pytest.importorskip("transformers")
    if cfg.arch == "qwen3":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as Rotary
    else:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as Rotary
    return Rotary(config=make_hf_config(cfg))


@pytest.mark.parametrize("name", NAMES)
def test_inv_freq_matches_transformers(name: str, make_hf_config) -> None:
    cfg = get_preset(name)
    rotary = _hf_rotary(cfg, make_hf_config)
    assert rotary.attention_scaling == 1.0
    torch.testing.assert_close(inv_freq(cfg).float(), rotary.inv_freq.float(),
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_rope_table_matches_transformers(name: str, make_hf_config) -> None:
    cfg = get_preset(name)
    rotary = _hf_rotary(cfg, make_hf_config)
    max_pos = 2048
    table = rope_table(cfg, max_pos)
    half = cfg.head_dim // 2
    assert table.shape == (max_pos, cfg.head_dim) and table.dtype == torch.float32
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, torch.arange(max_pos)[None])
    cos, sin = cos[0], sin[0]
    # HF duplicates the D/2 frequencies (rotate-half); we store each once. HF multiplies the
    # position by inv_freq in f32 (angle error ~ pos * 6e-8), so allow that much.
    torch.testing.assert_close(cos[:, half:], cos[:, :half])
    torch.testing.assert_close(table[:, :half], cos[:, :half], rtol=0, atol=3e-4)
    torch.testing.assert_close(table[:, half:], sin[:, :half], rtol=0, atol=3e-4)
    assert torch.equal(table[0, :half], torch.ones(half))


def test_llama3_scaling_changes_low_frequencies_only() -> None:
    scaled = get_preset("llama-3.1-8b")
    plain = dataclasses.replace(scaled, rope_scaling=None)
    a, b = inv_freq(scaled), inv_freq(plain)
    assert torch.equal(a[:8], b[:8])            # high frequencies: unchanged
    torch.testing.assert_close(a[-4:], b[-4:] / 8, rtol=1e-12, atol=0)  # lowest: divided
    assert bool(((a < b) & (a > b / 8)).any())  # the smoothed band in between
