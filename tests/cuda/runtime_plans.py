"""Hand-built Plans that exercise the CUDA runtime itself (records, waits, signals, steps).

They pair with the stub kernels in stub_kinds/ (passed as `extra_includes`), which replace the
real silu_mul device code with `out = x + 1` on int32 tiles, so the runtime is tested
independently of any task kernel's numerics.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from mpk.compiler import record
from mpk.compiler.plan import Plan, PlanOp, PlanTensor

STUB_KINDS = Path(__file__).parent / "stub_kinds"
CHAIN_OPS = ("inc0", "inc1", "inc2")


def chain_plan(n: int = 1 << 16, tiles: int = 64, num_sms: int = 32) -> Plan:
    """Three ops per step over int32 [n] tensors split into `tiles` tiles:
        inc0: b[j] = a[j] + 1          waits inc2 of the previous step (RAW on a)
        inc1: c[j] = b[(j+1) % T] + 1  waits all of inc0 (reads another SM's tile)
        inc2: a[j] = c[j] + 1          waits all of inc1 (RAW on c; WAR on a via inc0)
    so one step maps a to roll(a, -1 tile) + 3 (see chain_expected). Tasks are dealt round-robin
    over `num_sms` SMs in program order (deadlock free)."""
    assert n % tiles == 0
    tile = n // tiles
    nbytes = n * 4
    tensors = (PlanTensor("a", (n,), "i32", "io", -1),
               PlanTensor("b", (n,), "i32", "activation", 0),
               PlanTensor("c", (n,), "i32", "activation", nbytes))
    a, b, c = 0, 1, 2
    io = ((a, b), (b, c), (c, a))  # (x, out) tensor ids per op
    waits = ([(2, tiles, 1)], [(0, tiles, 0)], [(1, tiles, 0)])
    ops = tuple(PlanOp(name, "silu_mul", (tiles, 1, 1), (("x", x), ("out", out)),
                       (("x", (0, None, None)), ("out", (0, None, None))), (), i * tiles)
                for i, (name, (x, out)) in enumerate(zip(CHAIN_OPS, io)))
    op_params = np.zeros((len(ops), record.PARAM_WORDS), dtype=np.int32)
    op_params[:, :3] = (1, n, tile)  # silu_mul params: batch, inter, tile_i

    recs = []
    for op_index, (x, out) in enumerate(io):
        for j in range(tiles):
            rec = np.zeros(record.WORDS, dtype=np.int64)
            rec[record.KIND], rec[record.OP], rec[record.TASK] = 0, op_index, op_index * tiles + j
            rec[record.NUM_WAITS] = len(waits[op_index])
            for w, triple in enumerate(waits[op_index]):
                rec[record.WAITS + record.WAIT_STRIDE * w:][:record.WAIT_STRIDE] = triple
            rec[record.NUM_SIGNALS] = 1
            rec[record.SIGNALS] = op_index
            rec[record.POINT:record.POINT + 3] = (j, 0, 0)
            rec[record.NUM_OPERANDS] = 2
            for s in range(record.MAX_OPERANDS):
                rec[record.OPERANDS + record.OPERAND_STRIDE * s] = -1
            src = (j + 1) % tiles if op_index == 1 else j
            for slot, (tid, t) in enumerate(((x, src), (out, j))):
                base = record.OPERANDS + record.OPERAND_STRIDE * slot
                rec[base] = tid
                rec[base + 1:base + 3] = record.split64(t * tile)
            rec[record.STREAM] = -1  # no weight pages
            recs.append(rec.astype(np.int32))

    lengths = np.zeros(num_sms, dtype=np.int32)
    per_sm: list[list[np.ndarray]] = [[] for _ in range(num_sms)]
    for task, rec in enumerate(recs):
        per_sm[task % num_sms].append(rec)
        lengths[task % num_sms] += 1
    instrs = np.zeros((num_sms, int(lengths.max()), record.WORDS), dtype=np.int32)
    for sm, rows in enumerate(per_sm):
        if rows:
            instrs[sm, :len(rows)] = np.stack(rows)
    return Plan(num_sms=num_sms, kinds=("silu_mul",), tensors=tensors, ops=ops,
                op_params=op_params, instrs=instrs, lengths=lengths,
                counter_counts=np.full(3, tiles, dtype=np.int32), arena_bytes=2 * nbytes)


def chain_expected(a: torch.Tensor, tiles: int, steps: int) -> torch.Tensor:
    """`a` after `steps` steps of chain_plan."""
    out = a.clone().reshape(tiles, -1)
    for _ in range(steps):
        out = torch.roll(out, shifts=-1, dims=0) + 3
    return out.reshape(-1)


def patch_record(plan: Plan, task: int, word: int, value: int) -> Plan:
    """A copy of `plan` with one word of one task's record changed."""
    sm, index = plan.locate(task)
    instrs = plan.instrs.copy()
    instrs[sm, index, word] = value
    return dataclasses.replace(plan, instrs=instrs, meta=dict(plan.meta))
