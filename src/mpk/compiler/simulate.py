"""Deadlock check: simulate in-order execution of the per-SM lists over two decode steps.

Each SM runs its list front to back; a task may start once all its waits are met. If some SM
can never advance, the lists can deadlock on the GPU too, and compilation fails naming the
blocked tasks. Event driven: an SM blocked on a counter is re-examined only when that counter
moves, so the cost is linear in tasks x waits.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from mpk.compiler import record
from mpk.errors import DeadlockError


def check_deadlock_free(instrs: np.ndarray, lengths: np.ndarray, num_counters: int,
                        steps: int = 2) -> None:
    num_sms = len(lengths)
    value = np.zeros(num_counters, dtype=np.int64)
    pos = np.zeros(num_sms, dtype=np.int64)  # index into the unrolled list (steps x length)
    blocked: dict[int, list[int]] = {}
    queue = deque(range(num_sms))
    while queue:
        sm = queue.popleft()
        while pos[sm] < steps * lengths[sm]:
            step, i = divmod(int(pos[sm]), int(lengths[sm]))
            rec = instrs[sm, i]
            missing = _unmet_wait(rec, step, value)
            if missing is not None:
                blocked.setdefault(missing, []).append(sm)
                break
            for c in record.decode_signals(rec):
                value[c] += 1
                queue.extend(blocked.pop(c, []))
            pos[sm] += 1
    stuck = [sm for sm in range(num_sms) if pos[sm] < steps * lengths[sm]]
    if stuck:
        details = []
        for sm in stuck[:8]:
            step, i = divmod(int(pos[sm]), int(lengths[sm]))
            details.append(f"SM {sm} task {int(instrs[sm, i, record.TASK])} (step {step})")
        raise DeadlockError("the per-SM task lists deadlock: " + "; ".join(details))


def _unmet_wait(rec: np.ndarray, step: int, value: np.ndarray) -> int | None:
    for c, count, prev in record.decode_waits(rec):
        if value[c] < record.wait_target(count, prev, step):
            return c
    return None
