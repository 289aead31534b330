"""allreduce: out = round(sum over ranks r of partial_r) (+ residual), the tensor-parallel sum.

Every rank of a tensor-parallel model computes a row-parallel linear (o_proj, down_proj) over
its slice of K and writes a PARTIAL product into `partial` [B, H] (f32, or bf16). This op sums
the G ranks' partials in fixed rank order 0, 1, .., G-1 (so every rank computes the identical
value, bit for bit), rounds it to the output dtype and adds the residual exactly once:

    out = bf16(bf16(partial_0 + partial_1 + ... + partial_{G-1}) + residual)

which is the single-rank linear's epilogue `bf16(bf16(x @ W^T) + residual)`: with f32 partials
the sum IS the full fp32 dot product, only summed in another order (see docs/tensor-parallel.md).

The peers' partials are not operands of this rank's Plan (they live in other ranks' memory), so
the task reads them through `tile.extra["peers"]`: the same tile of `partial` in every rank's
tensors, in rank order (mpk.testing.MultiRankCpuExecutor provides them, after every rank's
producer of that tile has run this step; mpk.parallel.group gathers them across processes). With ranks=1 the own partial is the only peer, so a
one-rank plan also runs on the plain CpuExecutor.

The grid splits H (grid axis 0 cuts dim 1 of partial, residual and out); B is never split.
sm90.cuh reads the peers' partials from their GPUs' memory (docs/tensor-parallel.md); it was
compiled (ptxas) but, with no multi-GPU machine, never run.
"""

from __future__ import annotations

import torch

from mpk.dtypes import DType
from mpk.errors import MpkError
from mpk.tasks.base import Access, OperandSpec, OpView, Param, TaskCost, TaskKind, Tile
from mpk.tasks.numerics import bf16
from mpk.tasks.registry import register


@register
class AllReduce(TaskKind):
    name = "allreduce"
    operands = (
        OperandSpec("partial", Access.READ),
        OperandSpec("residual", Access.READ, optional=True),
        OperandSpec("out", Access.WRITE),
    )
    params = (Param("batch"), Param("hidden"), Param("tile_n"), Param("ranks"),
              Param("partial_f32"), Param("has_residual"), Param("out_f32"))
    attrs = {"ranks": 1}
    reads_launch_params = True  # the peers' arenas, the flags, the step and the watchdog

    def default_splits(self, grid, tensors):
        return {"partial": (1, None, None), "residual": (1, None, None), "out": (1, None, None)}

    def check(self, op: OpView) -> None:
        ranks = op.attrs["ranks"]
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise op.error(f"ranks must be a positive int, got {ranks!r}")
        shape = op.shape("partial")
        if len(shape) != 2:
            raise op.error(f"partial must be [B, H], got {shape}")
        op.expect_dtype("partial", DType.F32, DType.BF16)
        op.expect_shape("out", shape)
        op.expect_dtype("out", DType.BF16, DType.F32)
        if op.has("residual"):
            op.expect_shape("residual", shape)
            op.expect_dtype("residual", op.tensors["out"].dtype)
        # Only H is cut: a tile is the same rows of every rank's partial, which is what the
        # cross-rank wait (and a future per-tile cross-GPU counter) is keyed on.
        for name in ("partial", "residual", "out"):
            if op.has(name):
                op.expect_unsplit(name, 0)
                op.expect_same_split(name, 1, "out", 1)

    def param_values(self, op: OpView) -> dict[str, int | float]:
        batch, hidden = op.shape("partial")
        return {"batch": batch, "hidden": hidden, "tile_n": op.tile_shape("out")[1],
                "ranks": op.attrs["ranks"],
                "partial_f32": int(op.tensors["partial"].dtype is DType.F32),
                "has_residual": int(op.has("residual")),
                "out_f32": int(op.tensors["out"].dtype is DType.F32)}

    def reference(self, tile: Tile) -> None:
        ranks = tile.attr("ranks")
        peers = tile.extra.get("peers")
        if peers is None:
            if ranks != 1:
                raise MpkError(f"layer '{tile.op.name}' (allreduce) sums {ranks} ranks' partials; "
                               f"run the rank plans with mpk.testing.MultiRankCpuExecutor")
            peers = [tile["partial"]]
        if len(peers) != ranks:
            raise MpkError(f"layer '{tile.op.name}' (allreduce): {len(peers)} peer partials for "
                           f"ranks={ranks}")
        # Fixed rank order, fp32: every rank adds the same numbers in the same order, so the
        # replicated hidden state stays bit-identical across ranks (tokens cannot diverge).
        acc = peers[0].float().clone()
        for peer in peers[1:]:
            acc += peer.float()
        out = tile["out"]
        if out.dtype == torch.bfloat16:
            acc = bf16(acc)  # round the product once, as the single-rank linear does
        if tile.has("residual"):
            acc = acc + tile["residual"].float()
        out.copy_(acc)

    def cost(self, op: OpView) -> TaskCost:
        batch, tile_n = op.tile_shape("out")
        ranks = op.attrs["ranks"]
        partial = op.tensors["partial"].dtype.itemsize
        out = op.tensors["out"].dtype.itemsize
        act = batch * tile_n * (ranks * partial + out * (2 if op.has("residual") else 1))
        return TaskCost(weight_bytes=0, act_bytes=act, flops=batch * tile_n * ranks)
