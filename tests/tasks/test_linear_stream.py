"""The linear kind's GPU weight stream, replayed on the CPU the way tasks/linear/sm90.cuh walks it.

`replay` mirrors the CUDA consumer: runs -> pages, warp w takes task units w, w+8, ...; a
block's row group per warp is (w - u0) mod nb and its k group (u - u0) // nb; each unit's lane
(g, t) reads 16 bytes at lane*16 (stream row g, k 8t..8t+7 of the unit's 32), whose 4-byte word j
meets the input's k pair MMA_KPAIRS[j] in the MMAs. It rebuilds every
output from the stream bytes alone, so a wrong layout, page cut or index formula shows up as a
wrong product. The CPU interpreter never uses the stream; this is its only check off the GPU.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from mpk.tasks.base import PAGE_BYTES
from mpk.tasks.linear import geometry as geo
from mpk.tasks.linear import task as linear_task
from mpk.tasks.numerics import fold_norm
from mpk.testing import cuda_constants

WARPS = 8
# The kernel's MMAs (sm90.cuh header; mma.m16n8k16 fragments): MMA 1's B registers are the lane's
# words 0, 1 and meet A registers a0, a2 of its input row, which in a natural-order staged row
# (batch <= 8: the lane's 16-byte read as the whole A fragment) are the input's k pairs 0 and 2;
# MMA 2's words 2, 3 meet a1, a3: pairs 1 and 3.
MMA_KPAIRS = (0, 2, 1, 3)


def _pages(stream: np.ndarray, shape: geo.LinearShape, task: int, offset: int) -> list[np.ndarray]:
    """The task's pages as byte arrays, cut as the loader cuts them (runs in order)."""
    pages, pos = [], offset
    for count, nbytes in geo.task_runs(shape, task):
        assert nbytes % 16 == 0 and 0 < nbytes <= PAGE_BYTES
        for _ in range(count):
            pages.append(stream[pos: pos + nbytes])
            pos += nbytes
    return pages


def _unit_rows(pages: list[np.ndarray], u: int) -> np.ndarray:
    """The [8, 32] bf16-as-float values of task unit u, read lane by lane like the kernel."""
    page = pages[u // geo.PAGE_UNITS]
    start = (u % geo.PAGE_UNITS) * geo.UNIT_BYTES
    unit = np.zeros((8, 32), dtype=np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        raw = page[start + lane * 16: start + lane * 16 + 16].view(np.uint16)
        values = (raw.astype(np.uint32) << 16).view(np.float32)
        for j, pair in enumerate(MMA_KPAIRS):
            unit[g, 8 * t + 2 * pair: 8 * t + 2 * pair + 2] = values[2 * j: 2 * j + 2]
    return unit


def replay(shape: geo.LinearShape, stream: torch.Tensor, x: np.ndarray) -> np.ndarray:
    """fp32 sums [B, stream rows of the whole op] from the stream, per task, as the kernel does."""
    data = stream.contiguous().view(torch.uint8).numpy()
    batch = x.shape[0]
    rows_total = 2 * shape.n if shape.silu else shape.n
    out = np.full((batch, rows_total + 8), np.nan, dtype=np.float64)
    offset = 0
    for task in range(shape.tasks):
        pages = _pages(data, shape, task, offset)
        offset += geo.task_stream_bytes(shape, task)
        lo, _ = geo.task_outputs(shape, task)
        row0 = 2 * lo if shape.silu else lo
        rgs = geo.task_row_groups(shape, task)
        sums = np.zeros((batch, rgs * 8), dtype=np.float64)
        u0 = 0
        for k0, k1 in geo.chunks(shape):
            nk = -(-(k1 - k0) // geo.UNIT_K)
            xc = np.zeros((batch, nk * geo.UNIT_K), dtype=np.float64)
            xc[:, : k1 - k0] = x[:, k0:k1]
            for start, nb in geo.blocks(rgs):
                for w in range(WARPS):
                    first = u0 + (w - u0) % WARPS
                    rgl = (first - u0) % nb
                    for u in range(first, u0 + nb * nk, WARPS):
                        kg = (u - u0) // nb
                        assert (u - u0) % nb == rgl  # one row group per warp per block
                        unit = _unit_rows(pages, u)
                        rg = start + rgl
                        sums[:, rg * 8: rg * 8 + 8] += xc[:, kg * 32: kg * 32 + 32] @ unit.T
                u0 += nb * nk
        out[:, row0: row0 + rgs * 8] = sums
    return out[:, :rows_total]


def _case(n: int, k: int, tasks: int, silu: bool, rms: bool, xc: int | None, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    wshape = (2, n, k) if silu else (n, k)
    weight = torch.randn(wshape, generator=g).to(torch.bfloat16)
    norm = torch.randn(k, generator=g).to(torch.bfloat16) if rms else None
    shape = geo.LinearShape(n=n, k=k, tasks=tasks, silu=silu, xc=xc if xc else -(-k // 32) * 32)
    stream = geo.build_stream(shape, weight, norm)
    total = sum(geo.task_stream_bytes(shape, t) for t in range(tasks))
    assert stream.numel() * 2 == total
    x = torch.randn(3, k, generator=g).to(torch.bfloat16).float().numpy().astype(np.float64)
    got = replay(shape, stream, x)
    # With a norm weight the stream holds bf16(W * g) (numerics.fold_norm), exactly.
    folded = weight if norm is None else fold_norm(weight, norm).to(torch.bfloat16)
    if norm is not None:
        assert not torch.equal(folded, weight)
    ws = geo.stream_rows(folded, silu)[: got.shape[1]].float().numpy().astype(np.float64)
    expected = x @ ws.T
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("n,k,tasks", [
    (1024, 1024, 128), (256, 1024, 7), (200, 576, 13), (96, 48, 5), (4096, 3072, 132),
    (64, 4096, 1), (8, 1024, 1), (17, 64, 3),
])
def test_plain_stream_replays_to_the_product(n: int, k: int, tasks: int) -> None:
    _case(n, k, tasks, silu=False, rms=False, xc=None, seed=n + k)


@pytest.mark.parametrize("n,k,tasks", [(3072, 1024, 132), (1536, 576, 132), (36, 64, 5),
                                       (30, 96, 4)])
def test_silu_stream_pairs_gate_and_up(n: int, k: int, tasks: int) -> None:
    _case(n, k, tasks, silu=True, rms=True, xc=None, seed=n)


@pytest.mark.parametrize("xc", [256, 2048, 3584])
def test_chunked_stream(xc: int) -> None:
    _case(200, 7168, 9, silu=False, rms=True, xc=xc, seed=xc)


def test_blocks_are_greedy_powers_of_two() -> None:
    assert geo.blocks(13) == [(0, 8), (8, 4), (12, 1)]
    assert geo.blocks(7) == [(0, 4), (4, 2), (6, 1)]
    assert geo.blocks(0) == []


def test_page_runs_cover_the_units() -> None:
    shape = geo.LinearShape(n=1000, k=576, tasks=7, silu=False, xc=576)
    for t in range(7):
        runs = geo.task_runs(shape, t)
        units = sum(c * b for c, b in runs) // geo.UNIT_BYTES
        assert units == geo.num_units(shape, t) == len(geo.unit_order(shape, t))


# ---- finish_shared's partial sums in shared memory ----------------------------------------------
def _worst_bank_conflict(addresses: list[int]) -> int:
    """Distinct 4-byte words one warp instruction asks of the same bank (1: none)."""
    banks: dict[int, set[int]] = {}
    for a in addresses:
        banks.setdefault(a % 32, set()).add(a)
    return max((len(words) for words in banks.values()), default=0)


def test_partials_layout_has_at_most_two_way_bank_conflicts() -> None:
    """sm90.cuh's finish_shared: warp w stores lane (g, t)'s sums j (row 2t + (j & 1), batch g +
    8 (j >> 1)) at w * kPartWarp + row * kPartRow + batch; thread tid then sums pair (row 2 (tid
    div B), batch tid mod B) over the warps that met its row group. Unpadded (16, 128), batch 1
    made every thread's loads hit one bank (16 ways): the padding must keep every batch, block
    size and epilogue at 2 ways or fewer, and task.py must reserve what the CUDA code carves."""
    defined = cuda_constants((Path(linear_task.__file__).parent / "sm90.cuh").read_text())
    row, warp = defined["kPartRow"], defined["kPartWarp"]
    warps = geo.WARPS
    assert linear_task.PART_BYTES == 2 * warps * warp * 4

    def at(w: int, r: int, b: int) -> int:
        return w * warp + r * row + b

    for j in range(4):
        stores = [at(0, 2 * (lane & 3) + (j & 1), (lane >> 2) + 8 * (j >> 1)) for lane in range(32)]
        assert _worst_bank_conflict(stores) <= 2
    for batch, nb, silu, u0 in itertools.product((1, 2, 4, 8, 16), (1, 2, 4), (False, True),
                                                 range(4)):
        shift = 2 if silu else 3
        for first_warp, j, e in itertools.product(range(warps), range(warps), range(2)):
            loads = []
            for tid in range(32 * first_warp, 32 * first_warp + 32):
                if tid >= nb * (2 if silu else 4) * batch:
                    continue
                b, pair_row = tid % batch, 2 * (tid // batch)
                rgl, r = pair_row >> shift, pair_row & ((1 << shift) - 1)
                w = ((u0 % nb + rgl) & (nb - 1)) + j * nb
                if w < warps:
                    loads.append(at(w, r + e, b))
            assert _worst_bank_conflict(loads) <= 2, (batch, nb, silu, u0, j)
