"""Sampling with a counter-based generator, shared by the interpreter and the CUDA kernels.

A row with temperature T > 0 draws token i with probability softmax(logits / T)_i by the
Gumbel-max trick: token = argmax_i (logit_i / T + g_i), g_i = -log(-log(u_i)), where
u_i = U(seed, position, i) depends only on the request's seed, the position of the token being
produced and the vocabulary index: reproducible for a given seed whatever the batch beside it,
and free to compute inside lm_head's epilogue, tile by tile (no second pass over the logits).
tasks/common/sampling.cuh computes the same bits (splitmix64 finaliser; u has 24 bits); the
float logarithms may differ in the last bit between the CPU and the GPU.
"""

from __future__ import annotations

import numpy as np
import torch

M1, M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
GOLDEN, GOLDEN2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD1B54A32D192ED03)


def _mix64(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * M1
    x = (x ^ (x >> np.uint64(27))) * M2
    return x ^ (x >> np.uint64(31))


def uniform(seed: int, position: int, indices: np.ndarray) -> np.ndarray:
    """float32 in (0, 1), exact multiples of 2^-24: U(seed, position, i) for each index."""
    with np.errstate(over="ignore"):
        h1 = _mix64(np.uint64(seed) ^ _mix64(np.uint64(position) + GOLDEN))
        h = _mix64(h1 + indices.astype(np.uint64) * GOLDEN2)
    odd = (h >> np.uint64(41)).astype(np.float32) * np.float32(2) + np.float32(1)
    return odd * np.float32(2.0 ** -24)


def gumbel(seed: int, position: int, indices: np.ndarray) -> torch.Tensor:
    u = uniform(seed, position, indices)
    return torch.from_numpy(-np.log(-np.log(u)))


def perturbed(values: torch.Tensor, temperature: float, seed: int, position: int,
              first_index: int) -> torch.Tensor:
    """values / T + g for the vocabulary slice starting at `first_index` (fp32, as the kernel)."""
    idx = np.arange(first_index, first_index + values.shape[-1])
    scaled = values.float() / torch.tensor(temperature, dtype=torch.float32)
    return scaled + gumbel(seed, position, idx)


def split_seed(seed: int) -> tuple[int, int]:
    """A 64-bit seed as two int32 words (low, high) for the SAMPLING IO tensor."""
    lo, hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    return (lo - (1 << 32) if lo >= 1 << 31 else lo), (hi - (1 << 32) if hi >= 1 << 31 else hi)
