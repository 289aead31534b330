"""Execution orders for the interpreter. All respect the dependency counters; they differ in
which ready task runs next, so that a missing dependency shows up as a wrong result.

schedule: the per-SM lists, deterministic (what the GPU would do with no timing surprises).
random:   the per-SM lists, picking a random SM among those that can advance.
free:     ignore the SM assignment: any task whose waits are met may run (random choice, or
          a priority function), instances of one task still in step order.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterator

import numpy as np

from mpk.compiler import record
from mpk.compiler.plan import Plan

ORDERS = ("schedule", "random", "free")


class Counters:
    """Monotonic counter values plus the instances blocked on each counter."""

    def __init__(self, num_counters: int) -> None:
        self.value = np.zeros(num_counters, dtype=np.int64)

    def unmet(self, rec: np.ndarray, gstep: int) -> int | None:
        for c, count, prev in record.decode_waits(rec):
            if self.value[c] < record.wait_target(count, prev, gstep):
                return c
        return None

    def arrive(self, counter: int, count: int) -> bool:
        """A task's own add to an arrival counter (TaskKind.arrivals): did it complete the
        group's `count` (a step adds all of them or none)?"""
        self.value[counter] += 1
        return bool(self.value[counter] % count == 0)

    def signal(self, rec: np.ndarray) -> list[int]:
        out = record.decode_signals(rec)
        for c in out:
            self.value[c] += 1
        return out


def per_sm_order(plan: Plan, counters: Counters, step_begin: int, num_steps: int,
                 rng: random.Random | None) -> Iterator[tuple[np.ndarray, int]]:
    """Yield (record, local step) following the per-SM lists."""
    lengths = [int(x) for x in plan.lengths]
    pos = [0] * plan.num_sms
    total = [num_steps * n for n in lengths]
    blocked: dict[int, list[int]] = {}
    ready = [sm for sm in range(plan.num_sms) if total[sm]]
    while ready:
        k = rng.randrange(len(ready)) if rng else 0
        sm = ready[k]
        step, i = divmod(pos[sm], lengths[sm])
        rec = plan.instrs[sm, i]
        missing = counters.unmet(rec, step_begin + step)
        if missing is not None:
            ready.pop(k)
            blocked.setdefault(missing, []).append(sm)
            continue
        yield rec, step
        for c in counters.signal(rec):
            ready.extend(blocked.pop(c, []))
        pos[sm] += 1
        if pos[sm] == total[sm]:
            ready.remove(sm)
    _check_done(pos, total)


def free_order(plan: Plan, counters: Counters, step_begin: int, num_steps: int,
               priority: Callable[[int], float]) -> Iterator[tuple[np.ndarray, int]]:
    """Yield (record, local step) in any order the counters allow, lowest priority first."""
    records = plan.records()
    n = len(records)
    next_step = [0] * n  # instances of one task run in step order
    heap: list[tuple[float, int, int]] = [(priority(t), t, 0) for t in range(n)]
    heapq.heapify(heap)
    blocked: dict[int, list[int]] = {}
    done = 0
    while heap:
        _, t, step = heapq.heappop(heap)
        rec = records[t]
        missing = counters.unmet(rec, step_begin + step)
        if missing is not None:
            blocked.setdefault(missing, []).append(t)
            continue
        yield rec, step
        done += 1
        for c in counters.signal(rec):
            for u in blocked.pop(c, []):
                heapq.heappush(heap, (priority(u), u, next_step[u]))
        next_step[t] += 1
        if next_step[t] < num_steps:
            heapq.heappush(heap, (priority(t), t, next_step[t]))
    if done != n * num_steps:
        stuck = sorted(t for ts in blocked.values() for t in ts)[:5]
        raise RuntimeError(f"interpreter stalled: tasks {stuck} can never run")


def _check_done(pos: list[int], total: list[int]) -> None:
    stuck = [sm for sm in range(len(pos)) if pos[sm] < total[sm]]
    if stuck:
        raise RuntimeError(f"interpreter stalled: SMs {stuck[:8]} can never advance")
