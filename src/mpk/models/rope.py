"""The RoPE table: cos and sin per position, computed the way Hugging Face does.

The megakernel reads one f32 row per position (cos of the D/2 frequencies, then their sin) and
applies rotate-half RoPE. Computing it in float64 and casting once keeps the table as accurate
as f32 allows even at large positions (transformers itself multiplies in f32).
"""

from __future__ import annotations

import math

import torch

from mpk.errors import UnsupportedError
from mpk.models.config import ModelConfig


def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The D/2 inverse frequencies [D/2] float64, including llama3 scaling when configured.

    Mirrors transformers' `_compute_default_rope_parameters` / `_compute_llama3_parameters`."""
    dim = cfg.head_dim
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling_dict
    if scaling is None or scaling.get("rope_type") == "default":
        return freq
    if scaling.get("rope_type") != "llama3":
        raise UnsupportedError(f"rope_scaling {scaling} of {cfg.name!r} is not supported")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freq
    # Long wavelengths (low frequencies) are slowed down by `factor`; short ones stay; the band
    # in between is interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_table(cfg: ModelConfig, max_pos: int) -> torch.Tensor:
    """[max_pos, head_dim] float32: columns [0, D/2) hold cos(p * f_i), [D/2, D) sin(p * f_i)."""
    if max_pos <= 0:
        raise UnsupportedError(f"rope_table needs max_pos > 0, got {max_pos}")
    pos = torch.arange(max_pos, dtype=torch.float64)
    angles = pos[:, None] * inv_freq(cfg)[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).to(torch.float32)
