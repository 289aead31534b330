"""Sampling with a counter-based generator, shared by the interpreter and the CUDA kernels.

Each batch row's SAMPLING words (WORDS int32, this module owns the layout): temperature (float
bits; 0 = greedy), seed low, seed high, top_k (0 = no limit), top_p as P = floor(top_p * 2^24)
(0 = no limit). An all-zero row is greedy.

A row with temperature T > 0 draws token i with probability softmax(logits / T)_i by the
Gumbel-max trick: token = argmax_i (logit_i / T + g_i), g_i = -log(-log(u_i)), where
u_i = U(seed, position, i) depends only on the request's seed, the position of the token being
produced and the vocabulary index: reproducible for a given seed whatever the batch beside it,
and free to compute inside lm_head's epilogue, tile by tile (no second pass over the logits).
tasks/common/sampling.cuh computes the same bits (splitmix64 finaliser; u has 24 bits); the
float logarithms may differ in the last bit between the CPU and the GPU.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch

# The SAMPLING row (int32 words) and the fixed-point scales of the top-p arithmetic.
TEMPERATURE, SEED_LO, SEED_HI, TOP_K, TOP_P = range(5)
WORDS = 5
FIELDS = {"TEMPERATURE": TEMPERATURE, "SEED_LO": SEED_LO, "SEED_HI": SEED_HI, "TOP_K": TOP_K,
          "TOP_P": TOP_P}  # the names the CUDA code sees (SAMPLING_<NAME>)
P_ONE = 1 << 24  # top_p 1.0 as P
MASS_ONE = float(1 << 32)  # the top token's mass

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


def _int32(word: int) -> int:
    word &= 0xFFFFFFFF
    return word - (1 << 32) if word >= 1 << 31 else word


def split_seed(seed: int) -> tuple[int, int]:
    """A 64-bit seed as two int32 words (low, high) for the SAMPLING IO tensor."""
    return _int32(seed), _int32(seed >> 32)


def encode(temperature: float, seed: int, top_k: int = 0, top_p: float = 1.0) -> tuple[int, ...]:
    """One row of the SAMPLING input (temperature 0: the greedy row, all zeros)."""
    if temperature == 0:
        return (0,) * WORDS
    words = [0] * WORDS
    words[TEMPERATURE] = struct.unpack("<i", struct.pack("<f", float(temperature)))[0]
    words[SEED_LO], words[SEED_HI] = split_seed(seed)
    words[TOP_K] = top_k
    p = min(int(np.float32(top_p) * np.float32(P_ONE)), P_ONE)
    words[TOP_P] = 0 if p >= P_ONE else max(p, 1)
    return tuple(words)


@dataclass(frozen=True)
class RowSampling:
    """One row's SAMPLING words, decoded."""

    temperature: float
    seed: int
    top_k: int
    top_p_fixed: int  # P = floor(top_p * 2^24); 0 = no nucleus

    @classmethod
    def decode(cls, words: list[int]) -> RowSampling:
        temperature = struct.unpack("<f", struct.pack("<i", words[TEMPERATURE]))[0]
        seed = (words[SEED_LO] & 0xFFFFFFFF) | ((words[SEED_HI] & 0xFFFFFFFF) << 32)
        p = words[TOP_P] if 0 < words[TOP_P] < P_ONE else 0  # as the kernel reads it
        return cls(temperature, seed, max(words[TOP_K], 0), p)

    @property
    def samples(self) -> bool:
        return self.temperature > 0

    @property
    def filters(self) -> bool:
        """Sampling restricted to a top-k / nucleus set (argmax_reduce reads the logits)."""
        return self.samples and (self.top_k > 0 or self.top_p_fixed > 0)


def ordered_keys(values: np.ndarray) -> np.ndarray:
    """uint32 keys in the order of the float32 values (-0 as +0, NaN above everything)."""
    values = np.where(values == 0, np.float32(0), values).astype(np.float32)
    bits = values.view(np.uint32)
    keys = np.where(bits >> np.uint32(31) != 0, ~bits, bits | np.uint32(0x80000000))
    return np.where(np.isnan(values), np.uint32(0xFFFFFFFF), keys).astype(np.uint32)


def masses(logits: np.ndarray, temperature: float, top_logit: np.float32) -> np.ndarray:
    """Integer masses floor(exp(l / T - top / T) * 2^32) (uint64): exp of float32 values as the
    kernel computes them; integers so that every sum is exact and order-free."""
    t = np.float32(temperature)
    scaled = (logits.astype(np.float32) / t).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp((scaled - np.float32(top_logit / t)).astype(np.float32)).astype(np.float32)
    e = np.nan_to_num(e, nan=0.0)  # the GPU converts NaN to 0 (non-finite logits, l / T overflow)
    return np.floor(e.astype(np.float64) * MASS_ONE).astype(np.uint64)


def nucleus_target(total: int, p_fixed: int) -> int:
    """floor(total * P / 2^24), at least 1: the mass the nucleus must reach."""
    return max((total >> 24) * p_fixed + (((total & 0xFFFFFF) * p_fixed) >> 24), 1)


def kept_threshold(logits: np.ndarray, row: RowSampling) -> int:
    """The smallest key a token may have and still be sampled (tokens with ordered_keys >= it).

    top-k: the k-th largest key (ties with it are kept, as vLLM does). top-p: among those, the
    largest key v whose tokens with keys >= v hold at least nucleus_target of their mass (the
    smallest nucleus reaching top_p, ties kept). The CUDA kernel finds the same keys by radix
    selection."""
    keys = ordered_keys(logits)
    lo = 0
    if 0 < row.top_k < len(keys):
        lo = int(np.partition(keys, len(keys) - row.top_k)[len(keys) - row.top_k])
    if row.top_p_fixed:
        kept = keys >= lo
        top = logits[int(np.argmax(keys))]
        w = masses(logits[kept], row.temperature, top)
        order = np.argsort(keys[kept], kind="stable")[::-1]
        cum = np.cumsum(w[order], dtype=np.uint64)
        if cum[-1] > 0:  # 0 only when top / T is not finite: no mass to measure, top-k stays
            first = int(np.searchsorted(cum, nucleus_target(int(cum[-1]), row.top_p_fixed)))
            lo = int(keys[kept][order][first])
    return lo


def sample_filtered(logits: torch.Tensor, row: RowSampling, position: int) -> int:
    """The token a filtering row draws: Gumbel-max of logits / T over the kept tokens (lowest
    index on ties), the same noise as lm_head's epilogue."""
    values = logits.float().numpy()
    kept = np.flatnonzero(ordered_keys(values) >= kept_threshold(values, row))
    # as perturbed() computes it, for the kept indices only (each with its own index's noise)
    ranked = logits[kept].float() / torch.tensor(row.temperature, dtype=torch.float32)
    ranked = ranked + gumbel(row.seed, position, kept)
    return int(kept[int(torch.argmax(ranked))])
