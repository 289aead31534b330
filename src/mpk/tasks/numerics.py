"""Rounding rules shared by the task references: fp32 math, bf16 wherever the model stores a value.

The CUDA kernels round at the same points, so GPU and interpreter agree to bf16 precision.
"""

from __future__ import annotations

import torch


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 and come back to fp32 (the value a bf16 store would hold)."""
    return x.to(torch.bfloat16).float()


def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as Hugging Face does it: normalise in fp32, round to bf16,
    multiply by the bf16 weight, round again. Returns fp32 holding bf16 values."""
    return bf16(weight.float() * bf16(x.float() * rms_inv(x, eps)))


def rms_inv(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row's inverse rms over the last dim, in fp32 ([..., 1])."""
    xf = x.float()
    return torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)


def fold_norm(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """A linear's weight [..., K] with an RMSNorm's weight [K] folded into its columns, rounded
    to bf16 (fp32 holding bf16 values): rmsnorm(x) @ W^T = inv_rms(x) * (x @ fold^T) up to that
    rounding, which stands where rmsnorm_rows rounds the normalised input."""
    return bf16(weight.float() * norm_weight.float())


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """bf16(bf16(silu(gate)) * up), as a bf16 model computes act(gate) * up."""
    return bf16(bf16(torch.nn.functional.silu(gate.float())) * up.float())
