"""linear: out = prologue(x) @ weight^T (+ residual), fp32 accumulation.

weight [N, K] with out [B, N], or a stack weight [M, N, K] with out [B, M, N] (several matrices
sharing one input, e.g. gate/up or grouped QKV). Prologues, fused so they cost no extra phase:
  none:     x [B, K]
  rmsnorm:  x [B, K], norm_weight [K]: the input is rmsnorm(x) (see tasks/rmsnorm)
  silu_mul: x [B, 2, K]: the input is silu(x[:, 0]) * x[:, 1] (see tasks/silu_mul)
The product is rounded to the output dtype before the residual is added (as a bf16 model does).
The grid splits weight rows (N, and M for stacks); out and residual follow; x is never split.
"""

from __future__ import annotations

import math

import torch

from mpk.dtypes import DType
from mpk.tasks.base import Access, OpView, OperandSpec, Param, TaskCost, TaskKind, Tile
from mpk.tasks.numerics import bf16, rmsnorm_rows, silu_mul
from mpk.tasks.registry import register

PROLOGUES = ("none", "rmsnorm", "silu_mul")


@register
class Linear(TaskKind):
    name = "linear"
    operands = (
        OperandSpec("x", Access.READ),
        OperandSpec("norm_weight", Access.READ, optional=True, weight=True),
        OperandSpec("weight", Access.READ, weight=True),
        OperandSpec("residual", Access.READ, optional=True),
        OperandSpec("out", Access.WRITE),
    )
    params = (
        Param("batch"), Param("k"), Param("n"), Param("m"),
        Param("tile_m"), Param("tile_n"), Param("prologue"), Param("has_residual"),
        Param("out_f32"), Param("eps", is_float=True),
    )
    attrs = {"prologue": "none", "eps": 1e-6}

    def default_splits(self, grid, tensors):
        if len(tensors["weight"].shape) == 2:
            return {"weight": (0, None, None), "out": (1, None, None),
                    "residual": (1, None, None)}
        return {"weight": (0, 1, None), "out": (1, 2, None), "residual": (1, 2, None)}

    def check(self, op: OpView) -> None:
        prologue = op.attrs["prologue"]
        if prologue not in PROLOGUES:
            raise op.error(f"prologue {prologue!r} is not one of {PROLOGUES}")
        wshape = op.shape("weight")
        if len(wshape) not in (2, 3):
            raise op.error(f"weight must be [N, K] or [M, N, K], got {wshape}")
        k = wshape[-1]
        batch = op.shape("x")[0]
        if prologue == "silu_mul":
            op.expect_shape("x", (batch, 2, k))
        elif math.prod(op.shape("x")[1:]) != k:
            raise op.error(f"tensor '{op.tensors['x'].name}' (operand 'x') has shape "
                           f"{op.shape('x')}, but weight '{op.tensors['weight'].name}' "
                           f"{wshape} needs K={k} values per row")
        op.expect_shape("out", (batch, *wshape[:-1]))
        op.expect_dtype("x", DType.BF16)
        op.expect_dtype("weight", DType.BF16)
        op.expect_dtype("out", DType.BF16, DType.F32)
        if (prologue == "rmsnorm") != op.has("norm_weight"):
            raise op.error("norm_weight is given exactly when prologue='rmsnorm'")
        if op.has("norm_weight"):
            op.expect_shape("norm_weight", (k,))
            op.expect_dtype("norm_weight", DType.BF16)
        if op.has("residual"):
            op.expect_shape("residual", op.shape("out"))
            op.expect_dtype("residual", op.tensors["out"].dtype)
        self._check_splits(op, len(wshape))

    def _check_splits(self, op: OpView, rank: int) -> None:
        op.expect_unsplit("x", *range(len(op.shape("x"))))
        op.expect_unsplit("weight", rank - 1)
        op.expect_unsplit("out", 0)
        for wdim in range(rank - 1):
            op.expect_same_split("weight", wdim, "out", wdim + 1)
            if op.has("residual"):
                op.expect_same_split("residual", wdim + 1, "out", wdim + 1)
        if op.has("norm_weight"):
            op.expect_unsplit("norm_weight", 0)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        wshape, tile = op.shape("weight"), op.tile_shape("weight")
        return {
            "batch": op.shape("x")[0], "k": wshape[-1], "n": wshape[-2],
            "m": wshape[0] if len(wshape) == 3 else 1,
            "tile_m": tile[0] if len(tile) == 3 else 1, "tile_n": tile[-2],
            "prologue": PROLOGUES.index(op.attrs["prologue"]),
            "has_residual": int(op.has("residual")),
            "out_f32": int(op.tensors["out"].dtype is DType.F32), "eps": op.attrs["eps"],
        }

    def reference(self, tile: Tile) -> None:
        x = linear_input(tile)
        w = tile["weight"]
        k = w.shape[-1]
        y = (x @ w.reshape(-1, k).float().T).reshape(x.shape[0], *w.shape[:-1])
        out = tile["out"]
        if out.dtype == torch.bfloat16:
            y = bf16(y)
        if tile.has("residual"):
            y = y + tile["residual"].float()
        out.copy_(y)

    def cost(self, op: OpView) -> TaskCost:
        tile = op.tile_shape("weight")
        rows = tile[0] * tile[1] if len(tile) == 3 else tile[0]
        k, batch = tile[-1], op.shape("x")[0]
        x_elems = batch * k * (2 if op.attrs["prologue"] == "silu_mul" else 1)
        out_bytes = batch * rows * op.tensors["out"].dtype.itemsize
        return TaskCost(weight_bytes=2 * rows * k, act_bytes=2 * x_elems + 2 * out_bytes,
                        flops=2 * batch * rows * k)


def linear_input(tile: Tile) -> torch.Tensor:
    """The fp32 (bf16-valued) input rows after the prologue."""
    prologue = tile.attr("prologue")
    x = tile["x"]
    if prologue == "rmsnorm":
        return rmsnorm_rows(x, tile["norm_weight"], tile.attr("eps"))
    if prologue == "silu_mul":
        return silu_mul(x[:, 0], x[:, 1])
    return x.reshape(x.shape[0], -1).float()
