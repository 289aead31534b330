"""Where a linear task's weight bytes sit in its GPU stream, and in which order they are used.

One module owns this contract: the CUDA loader cuts the stream into pages, the consumer warps of
tasks/linear/sm90.cuh walk the units in exactly this order, and `build_stream` lays the weights
out so (tests/tasks/test_linear_stream.py replays the consumer walk on the CPU). The CPU
interpreter never sees a stream: it reads the weight in its Hugging Face layout.

Vocabulary
- stream matrix Ws [R, K]: the weight rows in output order. Plain linear: the weight [N, K].
  silu_mul epilogue: gate [N, K] and up [N, K] interleaved by four rows (Ws row 8j+i is gate row
  4j+i for i < 4 and up row 4j+i-4 otherwise), so one row group holds four outputs' gate AND up
  rows and the epilogue pairs them inside one warp.
- row group (rg): 8 consecutive rows of Ws, the N of one mma.m16n8k16 (the staged input rows are
  its M).
- unit: one row group x 32 k, 512 bytes, [8][32] bf16: lane 4g+t reads its 16 bytes at lane*16
  (conflict-free), stream row g's k 8t..8t+7 with its four k pairs in LANE_KPAIRS order, and they
  are its B fragments for two MMAs (sm90.cuh's header: the pairs meet a natural-order input).
- chunk: a range of at most `xc` k (the input rows staged in shared memory at once).
- block: 8, 4, 2 or 1 consecutive row groups of one chunk (greedy from the task's first row
  group). Units of a block are kg-major: (kg 0: rg 0..n-1), (kg 1: ...), so consumer warp w,
  which takes the units u = w, w+8, ... of the task, always meets the same row group of a block:
  rgl = (w - block_start) mod n (n divides 8), and its k groups are kg = (u - start) div n.
- page: 32 consecutive units (16 KB), the last one shorter.
- rmsnorm prologue: the stream holds the weight with the norm weight folded into its columns,
  bf16(W * g) (numerics.fold_norm); the kernel scales each row's sums by its inverse rms.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mpk.tasks.base import PAGE_BYTES, TASK_WARPS, split_bounds
from mpk.tasks.numerics import fold_norm

ROWS = 8  # rows per row group
UNIT_K = 32  # k per unit
UNIT_BYTES = ROWS * UNIT_K * 2
PAGE_UNITS = PAGE_BYTES // UNIT_BYTES  # 32
# Word j (4 bytes) of a lane's 16-byte read holds k pair LANE_KPAIRS[j] (k 8t + 2p, +1) of its
# 8: MMA 1 takes words 0, 1 against the input's pairs 0, 2 (its A registers a0, a2 of a staged
# natural-order row), MMA 2 words 2, 3 against pairs 1, 3 (a1, a3).
LANE_KPAIRS = (0, 2, 1, 3)
# The k order of a unit's rows in the stream: lane word order within each 8 k.
_UNIT_K_ORDER = [8 * t + 2 * p + e for t in range(UNIT_K // 8) for p in LANE_KPAIRS for e in (0, 1)]
WARPS = TASK_WARPS  # a block of 8 row groups gives each warp one row group
BLOCK_SIZES = (8, 4, 2, 1)
MAX_RUNS = 3  # (page count, bytes) runs of a task's stream (record.STREAM_RUNS)


@dataclass(frozen=True)
class LinearShape:
    """What the geometry needs to know of a linear op (mirrored by params in task.py)."""

    n: int  # output rows (plain: weight rows; silu_mul: act columns)
    k: int
    tasks: int  # grid axis 0
    silu: bool  # gate/up interleaved, outputs = n act columns
    xc: int  # k per chunk (a multiple of UNIT_K)

    @property
    def align(self) -> int:
        """Outputs per row group: a task's range starts at a multiple of this."""
        return ROWS // 2 if self.silu else ROWS


def task_outputs(shape: LinearShape, task: int) -> tuple[int, int]:
    return split_bounds(shape.n, shape.tasks, shape.align, task)


def task_row_groups(shape: LinearShape, task: int) -> int:
    lo, hi = task_outputs(shape, task)
    return -(-(hi - lo) // shape.align)


def chunks(shape: LinearShape) -> list[tuple[int, int]]:
    return [(k0, min(shape.k, k0 + shape.xc)) for k0 in range(0, shape.k, shape.xc)]


def blocks(row_groups: int) -> list[tuple[int, int]]:
    """(first row group, row groups) of each block, greedy 8/4/2/1."""
    out, start = [], 0
    for size in BLOCK_SIZES:
        while row_groups - start >= size:
            out.append((start, size))
            start += size
    return out


def unit_order(shape: LinearShape, task: int) -> list[tuple[int, int, int]]:
    """Every unit of a task in stream order: (chunk index, row group, k group in the chunk)."""
    order = []
    for c, (k0, k1) in enumerate(chunks(shape)):
        nk = -(-(k1 - k0) // UNIT_K)
        for start, size in blocks(task_row_groups(shape, task)):
            for kg in range(nk):
                order.extend((c, start + rgl, kg) for rgl in range(size))
    return order


def num_units(shape: LinearShape, task: int) -> int:
    nks = sum(-(-(k1 - k0) // UNIT_K) for k0, k1 in chunks(shape))
    return nks * task_row_groups(shape, task)


def task_runs(shape: LinearShape, task: int) -> list[tuple[int, int]]:
    """The task's stream as (page count, page bytes) runs, in order."""
    runs = []
    units = num_units(shape, task)
    if units >= PAGE_UNITS:
        runs.append((units // PAGE_UNITS, PAGE_BYTES))
    if units % PAGE_UNITS:
        runs.append((1, (units % PAGE_UNITS) * UNIT_BYTES))
    return runs


def task_stream_bytes(shape: LinearShape, task: int) -> int:
    return sum(count * size for count, size in task_runs(shape, task))


def stream_rows(weight: torch.Tensor, silu: bool) -> torch.Tensor:
    """Ws [R, K]: the weight rows in output order (gate/up interleaved by four for silu_mul)."""
    if not silu:
        return weight.reshape(-1, weight.shape[-1])
    gate, up = weight[0], weight[1]
    n, k = gate.shape
    pad = -n % 4
    if pad:
        gate = torch.cat([gate, gate.new_zeros(pad, k)])
        up = torch.cat([up, up.new_zeros(pad, k)])
    return torch.stack([gate.reshape(-1, 4, k), up.reshape(-1, 4, k)], dim=1).reshape(-1, k)


def build_stream(shape: LinearShape, weight: torch.Tensor,
                 norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The whole op's stream (every task's, in task order) as bf16, on weight's device: one
    gather of [8, 32] units from the zero-padded stream matrix (of the weight with norm_weight,
    if given, folded into its columns)."""
    if norm_weight is not None:
        weight = fold_norm(weight, norm_weight).to(weight.dtype)
    ws = stream_rows(weight, shape.silu)
    k_pad = -(-shape.k // UNIT_K) * UNIT_K
    r_pad = -(-ws.shape[0] // ROWS) * ROWS + ROWS  # a zero row group for rows past the end
    padded = ws.new_zeros(r_pad, k_pad)
    padded[: ws.shape[0], : shape.k] = ws
    units = padded.reshape(r_pad // ROWS, ROWS, k_pad // UNIT_K, UNIT_K).permute(0, 2, 1, 3)
    units = units[..., torch.as_tensor(_UNIT_K_ORDER, device=weight.device)]
    rg_index, kg_index = _unit_index(shape, r_pad // ROWS - 1)
    device = weight.device
    gathered = units[torch.as_tensor(rg_index, device=device),
                     torch.as_tensor(kg_index, device=device)]  # [units, 8, 32]
    return gathered.reshape(-1)


def _unit_index(shape: LinearShape, zero_rg: int) -> tuple[np.ndarray, np.ndarray]:
    """For every unit of the op in stream order: its row group and 32-k group in the padded
    stream matrix (zero_rg: an all-zero row group for rows past the weight)."""
    rgs, kgs = [], []
    total_rgs = -(-(2 * shape.n if shape.silu else shape.n) // ROWS)
    for task in range(shape.tasks):
        lo, _ = task_outputs(shape, task)
        rg0 = (2 * lo if shape.silu else lo) // ROWS
        for c, (k0, k1) in enumerate(chunks(shape)):
            nk = -(-(k1 - k0) // UNIT_K)
            for start, size in blocks(task_row_groups(shape, task)):  # kg-major, then rg
                rgs.append(np.tile(np.arange(rg0 + start, rg0 + start + size), nk))
                kgs.append(np.repeat(np.arange(nk) + c * (shape.xc // UNIT_K), size))
    rg = np.concatenate(rgs) if rgs else np.zeros(0, dtype=np.int64)
    kg = np.concatenate(kgs) if kgs else np.zeros(0, dtype=np.int64)
    return np.where(rg < total_rgs, rg, zero_rg), kg
