"""A real small Plan and plausible fabricated profiling stamps for it (no GPU).

fabricate_stamps replays the per-SM lists the way the megakernel runs them: each SM takes its
records in order, a record starts once every wait's target count of signals has arrived, and
it runs for the cost model's estimate (+-20%). The next record to start is always the one that
can start earliest (a discrete-event simulation), so the stamps respect every dependency.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import numpy as np

from mpk.compiler import record
from mpk.compiler.lower import compile_graph
from mpk.compiler.plan import Plan
from mpk.compiler.schedule import CostModel
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import get_preset
from mpk.profile.timeline import COMPUTE, DONE, END, INPUT, NUM_STAMPS, READY, RUN, WAIT
from mpk.tasks.registry import get_kind

NUM_SMS = 8
ORIGIN_NS = 1_722_000_000_123_456_789  # %globaltimer is wall-clock-like: large absolute values
ISSUE_NS = 40  # thread 0 picks up a record and issues its prefetch
HANDOFF_NS = 300  # a signal becomes visible to a waiting SM
SEEN_NS = 30  # the controller's ready mark reaches the consumers
SIGNAL_NS = 150  # the storer's fence and counter adds after the consumers are done


def tiny_plan(num_sms: int = NUM_SMS) -> Plan:
    shape = DecodeShape(batch=1, steps_per_launch=4, max_pages=4, num_pages=4)
    return compile_graph(build_graph(get_preset("tiny-llama"), shape, num_sms=num_sms), num_sms)


def task_ns(plan: Plan) -> np.ndarray:
    """Cost-model run time of one task of each op, ns."""
    model = CostModel()
    out = np.zeros(len(plan.ops))
    for i, op in enumerate(plan.ops):
        cost = get_kind(op.kind).cost(plan.op_view(i))
        out[i] = 1e3 * (model.weight_us(cost, plan.num_sms) + model.act_us(cost, plan.num_sms)
                        + model.task_overhead_us)
    return out


def fabricate_stamps(plan: Plan, steps: int, seed: int = 0) -> np.ndarray:
    """int64 [steps, num_sms, max_len, NUM_STAMPS] stamps, zero past each list. The controller
    sees a record ready SEEN_NS before the consumers start it; linear tasks mark INPUT and
    COMPUTE at 30% and 70% of their body, other kinds set no marks (zero); the storer signals
    SIGNAL_NS after DONE."""
    rng = np.random.default_rng(seed)
    instrs, lengths = plan.instrs, plan.lengths.astype(int)
    durations = task_ns(plan)
    stamps = np.zeros((steps, plan.num_sms, instrs.shape[1], NUM_STAMPS), dtype=np.int64)
    pos = np.zeros(plan.num_sms, dtype=int)
    free = np.full(plan.num_sms, ORIGIN_NS, dtype=np.int64)
    signals: dict[int, list[int]] = defaultdict(list)  # counter -> sorted signal times
    while True:
        best = None
        for sm in range(plan.num_sms):
            if pos[sm] >= steps * lengths[sm]:
                continue
            s, i = divmod(int(pos[sm]), int(lengths[sm]))
            ready = _ready(instrs[sm, i], s, int(free[sm]) + ISSUE_NS, signals)
            if ready is not None and (best is None or ready < best[0]):
                best = (ready, sm, s, i)
        if best is None:
            break
        ready, sm, s, i = best
        rec = instrs[sm, i]
        end = ready + int(durations[rec[record.OP]] * rng.uniform(0.8, 1.2))
        row = stamps[s, sm, i]
        row[[WAIT, READY, RUN, DONE, END]] = (free[sm], ready - SEEN_NS, ready, end - SIGNAL_NS,
                                              end)
        if plan.kinds[rec[record.KIND]] == "linear":
            row[INPUT], row[COMPUTE] = ready + (end - ready) * 3 // 10, ready + (end - ready) * 7 // 10
        for j in range(rec[record.NUM_SIGNALS]):
            bisect.insort(signals[int(rec[record.SIGNALS + j])], end)
        free[sm] = end + 20
        pos[sm] += 1
    assert all(pos == steps * lengths), "fabrication deadlocked"
    return stamps


def _ready(rec: np.ndarray, step: int, earliest: int,
           signals: dict[int, list[int]]) -> int | None:
    """When all waits of `rec` in `step` are met (None: not yet known to be met)."""
    ready = earliest
    for c, count, prev in record.decode_waits(rec):
        target = (step + 1 - prev) * count
        if target <= 0:
            continue
        times = signals[c]
        if len(times) < target:
            return None
        ready = max(ready, times[target - 1] + HANDOFF_NS)
    return ready
