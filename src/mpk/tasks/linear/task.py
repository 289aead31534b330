"""linear: out = epilogue(prologue(x) @ weight^T), fp32 accumulation.

weight [N, K] with out [B, N]; with epilogue='silu_mul' a gate/up stack weight [2, N, K] and
out [B, N] = silu(gate) * up. The grid (T,) cuts the N outputs into T contiguous ranges that
start at multiples of 8 (4 for silu_mul) and differ by at most that much (split_bounds), so an
op can be spread over exactly one task per SM.
Prologues (fused, so they cost no extra phase):
  none:     x [B, K]
  rmsnorm:  x [B, K], norm_weight [K]: the input is rmsnorm(x) (see tasks/rmsnorm), computed as
            inv_rms(x) * (x @ fold^T) with fold = bf16(weight * norm_weight) (numerics.fold_norm:
            its rounding stands where rmsnorm rounds the normalised input), so the kernel
            streams the folded weight and scales each row's sums after the walk
Epilogues:
  none:     the product is rounded to out's dtype, then `residual` (optional) is added
  silu_mul: bf16(bf16(silu(bf16(x@gate))) * bf16(x@up)), as the unfused gate_up + silu_mul ops
  argmax:   also writes each task's best output and its global index to part_val / part_idx
            [B, T] (ties: lowest index; NaN wins), for argmax_reduce. With `sampling` [B, WORDS]
            i32 (tasks/sampling.py's row layout), `positions` [B] i32 and optionally `runs`
            [B, 2] i32 (tasks/runs.py), a row with temperature T > 0 ranks out / T + Gumbel
            noise instead (tasks/sampling.py: the token argmax_reduce picks is then a sample
            of softmax(logits / T) at the row's position positions[b] + step * width)
On the GPU the weights come as a stream of shared-memory pages in the order of geometry.py.
attr xc: k per staged chunk of the input (a multiple of 32); 0: chunk_k(B, K), the largest B's
staged rows fit. The chunks and the grid set the order of each output's sum over K (chunks add
in fp32 one after the other; the tasks' row groups set the blocks and the warps that meet an
output, sm90.cuh), so a plan that must round as a plan of more rows (the serving engine's one-row
plan, models/builder.DecodeShape.numerics_batch) gives that plan's xc and task count.
"""

from __future__ import annotations

import math

import torch

from mpk.dtypes import DType
from mpk.tasks.base import (Access, OpView, OperandSpec, Param, StreamLayout,
                            TaskCost, TaskKind, Tile, split_bounds)
from mpk.tasks import runs, sampling
from mpk.tasks.linear import geometry as geo
from mpk.tasks.numerics import bf16, fold_norm, rms_inv, silu_mul
from mpk.tasks.registry import register

PROLOGUES = ("none", "rmsnorm")
EPILOGUES = ("none", "silu_mul", "argmax")
# Shared memory for the staged input rows (bytes), by rows staged: at batch 9-16, 104 KB stages a
# K of 3,072 in one chunk (qwen3-0.6b's down; a chunk's staging is a round trip through L2 in the
# middle of the walk). Measured against 72 KB (two chunks there, two weight pages more): qwen3-0.6b
# b16 1.413 -> 1.363 ms, llama-3.2-1b b16 1.386 -> 1.361 (perf-log, twelfth session). Up to 8 rows
# keep 72 KB (K up to 4,480 in one chunk): their pages were not measured with less.
X_BUDGET_NARROW = 72 * 1024
X_BUDGET_WIDE = 104 * 1024
X_PAD = 32  # bf16 elements of padding per staged row (bank spread, see sm90.cuh)
PART_WARP = 144  # sm90.cuh kPartWarp: a warp's partial sums, 8 rows of 18 (bank padding)
PART_BYTES = 2 * geo.WARPS * PART_WARP * 4  # cross-warp partial sums, two buffers
MAX_BATCH = 16
POLL_VECS_MAX = 4  # sm90.cuh poll_stage: vectors a thread polls in flight, at most


def staged_rows(batch: int) -> int:
    """Input rows staged in shared memory: B, or 16 at batch 9-16 (rows past B zero, sm90.cuh)."""
    return batch if batch <= geo.ROWS else 2 * geo.ROWS


def staged_bytes(batch: int, xc: int) -> int:
    """Shared memory of the staged input (sm90.cuh carve): staged_rows rows of xc rounded up to
    2 * X_PAD, + X_PAD."""
    return staged_rows(batch) * (-(-xc // (2 * X_PAD)) * 2 * X_PAD + X_PAD) * 2


def x_budget(batch: int) -> int:
    """Shared memory for the staged input rows at this batch (bytes)."""
    return X_BUDGET_NARROW if batch <= geo.ROWS else X_BUDGET_WIDE


def chunk_k(batch: int, k: int) -> int:
    """k per staged chunk of the input: all of K when the staged rows fit x_budget, else equal
    chunks."""
    max_xc = max(256, (x_budget(batch) // (2 * staged_rows(batch)) - X_PAD) // 256 * 256)
    chunks = -(-k // max_xc)
    return -(-(-(-k // chunks)) // geo.UNIT_K) * geo.UNIT_K


# A chunked input (K x batch over x_budget) keeps fp32 sums of all the task's outputs in shared
# memory between chunks; this caps them (qwen3-8b's lm_head at batch 16 as 132 tasks needed 72 KB,
# leaving 3 weight pages).
ACC_BUDGET = 32 * 1024


def min_tasks(n: int, k: int, batch: int, align: int = geo.ROWS) -> int:
    """Fewest tasks for n outputs (`align` per row group: 8, or 4 for silu_mul's gate/up pairs)
    so a task's shared memory stays bounded: 1 unless the input is staged in chunks, else enough
    that each task's fp32 sums (8 stream rows x batch per row group) fit ACC_BUDGET."""
    if chunk_k(batch, k) >= k:
        return 1
    groups = max(1, ACC_BUDGET // (geo.ROWS * batch * 4))
    return -(-n // (groups * align))


@register
class Linear(TaskKind):
    name = "linear"
    operands = (
        OperandSpec("x", Access.READ),
        OperandSpec("norm_weight", Access.READ, optional=True, weight=True),
        OperandSpec("weight", Access.READ, weight=True),
        OperandSpec("residual", Access.READ, optional=True),
        OperandSpec("out", Access.WRITE),
        OperandSpec("part_val", Access.WRITE, optional=True),
        OperandSpec("part_idx", Access.WRITE, optional=True),
        OperandSpec("sampling", Access.READ, optional=True),
        OperandSpec("positions", Access.READ, optional=True),
        OperandSpec("runs", Access.READ, optional=True),
    )
    params = (
        Param("batch"), Param("k"), Param("n"), Param("tasks"), Param("silu"), Param("rms"),
        Param("xc"), Param("has_residual"), Param("out_f32"), Param("argmax"),
        Param("eps", is_float=True), Param("sampling"),
    )
    attrs = {"prologue": "none", "epilogue": "none", "eps": 1e-6, "xc": 0}
    # A prefill plan's lm_head beside gemm: inlined there, ptxas spilled ~700 B in the
    # consumers' loop (twenty-fifth session); out of line, none in gemm's k loop.
    outlined_beside_wgmma = True
    # In plans with a wide linear the CUDA prologue works out the task's parameters and the rows'
    # sampling words before the waits (sm90.cuh prologue).
    prologue_operands = ("sampling", "positions", "runs")
    # The kernel builds its walk for 9-16 rows (two staged rows an MMA fragment: more registers)
    # only where an op of the plan has more than 8 (geo.ROWS) rows: in a plan of 8 rows or fewer
    # its registers crowded ptxas' allocation of the whole kernel (cold spills in attention).
    # A flagged x is polled LINEAR_POLL_VECS 16-byte vectors a thread in flight (sm90.cuh
    # poll_stage): as many as the plan's largest flagged x needs for one round, 4 at most (16 KB
    # a round; compiler/flags.py's 32 KB take two), since four in flight where two suffice cost
    # qwen3-0.6b b1 ~1% (perf-log, twenty-ninth session).
    cuda_defaults = {"LINEAR_MAX_BATCH": MAX_BATCH, "LINEAR_POLL_VECS": POLL_VECS_MAX}

    def cuda_constants(self, op: OpView, flagged: frozenset[str] = frozenset()
                       ) -> dict[str, int]:
        constants = {"LINEAR_MAX_BATCH": op.shape("x")[0]}
        if "x" in flagged:
            vectors = math.prod(op.shape("x")) // 8
            constants["LINEAR_POLL_VECS"] = min(POLL_VECS_MAX, -(-vectors // (geo.WARPS * 32)))
        return constants

    def default_splits(self, grid, tensors):
        row_dim = len(tensors["weight"].shape) - 2
        return {"weight": (row_dim, None, None), "out": (1, None, None),
                "residual": (1, None, None), "part_val": (1, None, None),
                "part_idx": (1, None, None)}  # sampling and positions: whole, every task

    def split_align(self, op: OpView, operand: str) -> int | None:
        if operand in ("weight", "out", "residual"):
            return geo.ROWS // 2 if op.attrs["epilogue"] == "silu_mul" else geo.ROWS
        return None

    def check(self, op: OpView) -> None:
        prologue, epilogue = op.attrs["prologue"], op.attrs["epilogue"]
        if prologue not in PROLOGUES:
            raise op.error(f"prologue {prologue!r} is not one of {PROLOGUES}")
        if epilogue not in EPILOGUES:
            raise op.error(f"epilogue {epilogue!r} is not one of {EPILOGUES}")
        wshape = op.shape("weight")
        silu = epilogue == "silu_mul"
        if silu and (len(wshape) != 3 or wshape[0] != 2):
            raise op.error(f"epilogue 'silu_mul' needs a gate/up weight [2, N, K], got {wshape}")
        if not silu and len(wshape) != 2:
            raise op.error(f"weight must be [N, K] (a stack [2, N, K] only with epilogue "
                           f"'silu_mul'), got {wshape}")
        n, k = wshape[-2], wshape[-1]
        batch = op.shape("x")[0]
        if op.shape("x") != (batch, k):
            raise op.error(f"tensor '{op.tensors['x'].name}' (operand 'x') has shape "
                           f"{op.shape('x')}, but weight '{op.tensors['weight'].name}' "
                           f"{wshape} needs [B, {k}]")
        if not 1 <= batch <= MAX_BATCH:
            raise op.error(f"batch {batch}: the linear kernel takes 1 to {MAX_BATCH} rows")
        if k % 8:
            raise op.error(f"K={k} must be a multiple of 8 (the kernel stages inputs in 16-byte "
                           f"vectors)")
        op.expect_shape("out", (batch, n))
        op.expect_dtype("x", DType.BF16)
        op.expect_dtype("weight", DType.BF16)
        op.expect_dtype("out", DType.BF16, *(() if silu else (DType.F32,)))
        if (prologue == "rmsnorm") != op.has("norm_weight"):
            raise op.error("norm_weight is given exactly when prologue='rmsnorm'")
        if op.has("norm_weight"):
            op.expect_shape("norm_weight", (k,))
            op.expect_dtype("norm_weight", DType.BF16)
        if op.has("residual"):
            if epilogue != "none":
                raise op.error(f"a residual is added only with epilogue 'none', not {epilogue!r}")
            op.expect_shape("residual", op.shape("out"))
            op.expect_dtype("residual", op.tensors["out"].dtype)
        self._check_chunk(op, batch)
        self._check_argmax(op, batch)
        self._check_splits(op)

    def _check_chunk(self, op: OpView, batch: int) -> None:
        xc = op.attrs["xc"]
        if xc == 0:
            return
        # A chunk the widest staging holds: the shared-memory carve of a larger batch's chunk.
        if xc < 0 or xc % geo.UNIT_K or staged_bytes(batch, xc) > X_BUDGET_WIDE:
            raise op.error(f"xc {xc}: the input chunk must be a positive multiple of "
                           f"{geo.UNIT_K} whose {staged_rows(batch)} staged rows fit "
                           f"{X_BUDGET_WIDE // 1024} KB")

    def _check_argmax(self, op: OpView, batch: int) -> None:
        argmax = op.attrs["epilogue"] == "argmax"
        if argmax != op.has("part_val") or argmax != op.has("part_idx"):
            raise op.error("part_val and part_idx are given exactly when epilogue='argmax'")
        if argmax:
            op.expect_shape("part_val", (batch, op.grid[0]))
            op.expect_shape("part_idx", (batch, op.grid[0]))
            op.expect_dtype("part_val", DType.F32)
            op.expect_dtype("part_idx", DType.I32)
        if op.has("sampling") != op.has("positions") or (op.has("sampling") and not argmax):
            raise op.error("sampling and positions are given together, with epilogue='argmax'")
        if op.has("sampling"):
            op.expect_shape("sampling", (batch, sampling.WORDS))
            op.expect_shape("positions", (batch,))
            op.expect_dtype("sampling", DType.I32)
            op.expect_dtype("positions", DType.I32)
            op.expect_unsplit("sampling", 0, 1)
            op.expect_unsplit("positions", 0)
        if op.has("runs"):
            if not op.has("sampling"):
                raise op.error("runs are given with sampling and positions")
            op.expect_shape("runs", (batch, runs.WORDS))
            op.expect_dtype("runs", DType.I32)
            op.expect_unsplit("runs", 0, 1)

    def _check_splits(self, op: OpView) -> None:
        if op.grid[1] != 1 or op.grid[2] != 1:
            raise op.error(f"the grid cuts the outputs only: use grid (tasks,), got {op.grid}")
        rank = len(op.shape("weight"))
        op.expect_unsplit("x", 0, 1)
        op.expect_unsplit("weight", *[d for d in range(rank) if d != rank - 2])
        op.expect_unsplit("out", 0)
        if op.axis_of("weight", rank - 2) != op.axis_of("out", 1):
            raise op.error("weight rows (dim -2) and out dim 1 must be split by the same axis")
        for name in ("residual", "part_val", "part_idx"):
            if op.has(name):
                op.expect_unsplit(name, 0)
                op.expect_same_split(name, 1, "out", 1)
        if op.has("norm_weight"):
            op.expect_unsplit("norm_weight", 0)

    # ---- geometry and the CUDA side -----------------------------------------------------------
    def flag_operands(self, op: OpView) -> frozenset[str]:
        # Outputs are written in pairs of adjacent columns (sm90.cuh), after the walk: every read
        # of the task (x, the residual) is done by then.
        if op.attrs["epilogue"] == "argmax":
            return frozenset({"x"})
        return frozenset({"x", "residual", "out"})

    def shape_of(self, op: OpView) -> geo.LinearShape:
        wshape = op.shape("weight")
        return geo.LinearShape(n=wshape[-2], k=wshape[-1], tasks=op.grid[0],
                               silu=op.attrs["epilogue"] == "silu_mul",
                               xc=op.attrs["xc"] or chunk_k(op.shape("x")[0], wshape[-1]))

    def param_values(self, op: OpView) -> dict[str, int | float]:
        s = self.shape_of(op)
        return {
            "batch": op.shape("x")[0], "k": s.k, "n": s.n, "tasks": s.tasks,
            "silu": int(s.silu), "rms": int(op.attrs["prologue"] == "rmsnorm"), "xc": s.xc,
            "has_residual": int(op.has("residual")),
            "out_f32": int(op.tensors["out"].dtype is DType.F32),
            "argmax": int(op.attrs["epilogue"] == "argmax"), "eps": op.attrs["eps"],
            "sampling": int(op.has("sampling")),
        }

    def stream_layout(self, op: OpView) -> StreamLayout:
        s = self.shape_of(op)
        sizes = [geo.task_stream_bytes(s, t) for t in range(s.tasks)]
        offsets = [sum(sizes[:t]) for t in range(s.tasks)]
        sources = ("weight", "norm_weight") if op.has("norm_weight") else ("weight",)
        return StreamLayout(sources, tuple(offsets),
                            tuple(tuple(geo.task_runs(s, t)) for t in range(s.tasks)),
                            sum(sizes))

    def build_stream(self, op: OpView, sources) -> torch.Tensor:
        return geo.build_stream(self.shape_of(op), sources["weight"], sources.get("norm_weight"))

    def scratch_bytes(self, op: OpView) -> int:
        s = self.shape_of(op)
        batch = op.shape("x")[0]
        x_bytes = staged_bytes(batch, s.xc)
        extra = 0
        if len(geo.chunks(s)) > 1:  # fp32 sums across chunks
            rgs = max(geo.task_row_groups(s, t) for t in range(s.tasks))
            extra = rgs * geo.ROWS * batch * 4
        return x_bytes + PART_BYTES + extra + 1024  # + red, best, sampling (sm90.cuh carve)

    def reference(self, tile: Tile) -> None:
        if tile.attr("prologue") == "rmsnorm":
            x = tile["x"]
            project(tile, x.float(), fold_norm(tile["weight"], tile["norm_weight"]),
                    rms_inv(x, tile.attr("eps")))
        else:
            project(tile, tile["x"].float())
        out = tile["out"]
        if tile.attr("epilogue") == "argmax":
            first = split_bounds(tile.op.shape("out")[1], tile.op.grid[0],
                                 self.split_align(tile.op, "out"), tile.point[0])[0]
            val, idx = _ranked(tile, out.float(), first).max(dim=1)
            tile["part_val"][:, 0].copy_(val)
            tile["part_idx"][:, 0].copy_(idx.int() + first)

    def cost(self, op: OpView) -> TaskCost:
        s = self.shape_of(op)
        batch = op.shape("x")[0]
        rows = -(-s.n // s.tasks) * (2 if s.silu else 1)
        out_bytes = batch * rows * op.tensors["out"].dtype.itemsize
        return TaskCost(weight_bytes=2 * rows * s.k, act_bytes=2 * batch * s.k + 2 * out_bytes,
                        flops=2 * batch * rows * s.k)


def _ranked(tile: Tile, values: torch.Tensor, first: int) -> torch.Tensor:
    """What the argmax ranks per row: the values, or for a sampling row (temperature > 0) the
    values / T plus its Gumbel noise (tasks/sampling.py)."""
    if not tile.has("sampling"):
        return values
    ranked = values.clone()
    for b in range(values.shape[0]):
        row = sampling.RowSampling.decode(tile["sampling"][b].tolist())
        if row.samples:
            position = runs.position(int(tile["positions"][b]),
                                     tile["runs"][b] if tile.has("runs") else None, tile.step)
            ranked[b] = sampling.perturbed(values[b], row.temperature, row.seed, position, first)
    return ranked


def project(tile: Tile, x: torch.Tensor, weight: torch.Tensor | None = None,
            row_scale: torch.Tensor | None = None) -> None:
    """out = epilogue(row_scale * (x @ weight^T)) for the none / silu_mul epilogues and the
    residual (argmax ranks `out` afterwards), x the fp32 input rows, weight the tile's unless
    given (an rmsnorm prologue's folded weight), row_scale [B, 1] (its inverse rms) or none: the
    arithmetic linear and gemm share."""
    w = tile["weight"] if weight is None else weight
    y = x @ w.reshape(-1, w.shape[-1]).float().T
    if row_scale is not None:
        y = y * row_scale
    out = tile["out"]
    if tile.attr("epilogue") == "silu_mul":
        n = w.shape[1]
        out.copy_(silu_mul(bf16(y[:, :n]), bf16(y[:, n:])))
        return
    if out.dtype == torch.bfloat16:
        y = bf16(y)
    if tile.has("residual"):
        y = y + tile["residual"].float()
    out.copy_(y)

