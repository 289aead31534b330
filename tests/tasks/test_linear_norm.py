"""The linear kind's rmsnorm prologue: the norm weight folded into the weight's columns, each
row's sums scaled by its inverse rms afterwards (tasks/linear/task.py, numerics.fold_norm).

Its rounding differs from Hugging Face's (which rounds the normalised input, then its product
with the norm weight): each must be as close to the exact fp32 math as one bf16 rounding of its
operands allows, and the fold must not lose to the unfused path."""

from __future__ import annotations

import math

import torch

from mpk.compiler.fuse import fuse
from mpk.dtypes import DType
from mpk.graph.graph import Graph
from mpk.tasks.numerics import bf16, fold_norm, rms_inv, rmsnorm_rows
from mpk.tensors import Role

EPS = 1e-6


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_folded_norm_is_as_accurate_as_the_unfused_rmsnorm() -> None:
    g = torch.Generator().manual_seed(7)
    n, k = 512, 2048
    x = bf16(3.0 * torch.randn(4, k, generator=g))
    w = bf16(torch.randn(n, k, generator=g) / math.sqrt(k))
    nw = bf16(1.0 + 0.5 * torch.randn(k, generator=g))
    exact = (x * rms_inv(x, EPS) * nw) @ w.T
    unfused = rmsnorm_rows(x, nw, EPS) @ w.T
    folded = (x @ fold_norm(w, nw).T) * rms_inv(x, EPS)
    # bf16 keeps 8 significant bits: a rounding moves a value by at most u = 2^-8 of it, with a
    # standard deviation of at most u / sqrt(3). Rounding every term of a sum of many terms of
    # random sign moves it by that much relative to its norm; the unfused path rounds twice.
    one_rounding = 2.0**-8 / math.sqrt(3)
    assert _relative(folded, exact) < one_rounding
    assert _relative(folded, exact) <= _relative(unfused, exact)
    # Without the norm weight the product is far off: the fold is what carries it.
    assert _relative((x @ w.T) * rms_inv(x, EPS), exact) > 0.1


def test_rmsnorm_fuses_into_a_linear_of_any_k() -> None:
    """K = 12,288 (past the 8,192 a norm-weight page once held) takes the prologue too."""
    k, n = 12288, 64
    graph = Graph()
    graph.add_tensor("x", (1, k), DType.BF16, Role.IO)
    graph.add_tensor("nw", (k,), DType.BF16, Role.WEIGHT)
    graph.add_tensor("h", (1, k), DType.BF16, Role.ACTIVATION)
    graph.add_tensor("w", (n, k), DType.BF16, Role.WEIGHT)
    graph.add_tensor("y", (1, n), DType.BF16, Role.IO)
    graph.add_op("rmsnorm", "norm", (1,), {"x": "x", "weight": "nw", "out": "h"}, eps=EPS)
    graph.add_op("linear", "proj", (4,), {"x": "h", "weight": "w", "out": "y"})
    (op,) = fuse(graph).ops
    assert op.kind == "linear" and dict(op.attrs)["prologue"] == "rmsnorm"
    assert dict(op.operands)["norm_weight"] == "nw" and dict(op.operands)["x"] == "x"
