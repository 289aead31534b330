"""Static schedule: tasks -> one ordered list per SM, by list scheduling on a cost model.

Tasks are placed in program order (so every per-SM list is a subsequence of one global
topological order: the basis of the deadlock-freedom argument, checked by simulate.py).
Each task goes to the SM where the cost model says it finishes first. The model: a task's weight
bytes stream from HBM as soon as its SM is free (the runtime prefetches weights before waiting),
its prologue (TaskCost.prologue_round_trips) runs as soon as its SM is free too, and its
activation work starts once both the prologue and its producers have finished (plus a hand-off
latency). Without the prologue term a task that is cheap in the model (one of 16 KV splits)
lands right behind its SM's own producer task, its prologue then on the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpk.tasks.base import TaskCost


@dataclass(frozen=True)
class CostModel:
    """H200 figures, shared evenly by the SMs. Calibrated on 2026-11-29 against the measured
    ms/token of qwen3-0.6b, llama-3.2-1b and qwen3-8b (docs/perf-log.md): it predicts them
    within 10%. The weight-read floor uses the measured read bandwidth (4.0 TB/s); tasks stream
    at what the linear tiles reach inside the runtime (~3.0 TB/s), and each task pays a fixed
    cost (record, wait, barrier, fence + signal) plus a hand-off from its producers' SMs."""

    floor_bytes_per_us: float = 4.0e6  # whole GPU, torch.sum read bandwidth
    stream_bytes_per_us: float = 3.0e6  # whole GPU, what task tiles achieve
    l2_bytes_per_us: float = 12.0e6
    task_overhead_us: float = 4.0
    handoff_us: float = 2.0
    # A dependent L2 round trip under load (TaskCost.round_trips): qwen3-8b's prefill
    # rope_append made 14 of them (2 + 12 rounds) in 34 us a task, which this, its bytes and
    # the task overhead give (perf-log, thirty-fifth session). With 6 (a row's vectors at once)
    # its tasks still took 32 us on the H200, so this undercounts them; costed so, a layer's
    # tasks spread over the SMs all the same and the 2,048-token prefill went 82.5 -> 74.5 ms
    # (perf-log, thirty-sixth session).
    round_trip_us: float = 2.0

    def weight_us(self, cost: TaskCost, num_sms: int) -> float:
        return cost.weight_bytes / (self.stream_bytes_per_us / max(num_sms, 1))

    def act_us(self, cost: TaskCost, num_sms: int) -> float:
        return (cost.act_bytes / (self.l2_bytes_per_us / max(num_sms, 1))
                + cost.round_trips * self.round_trip_us)

    def prologue_us(self, cost: TaskCost) -> float:
        return cost.prologue_round_trips * self.round_trip_us


@dataclass(frozen=True)
class Schedule:
    sm_of_task: np.ndarray  # int [num_tasks]
    start_us: np.ndarray
    finish_us: np.ndarray
    busy_us: np.ndarray  # per SM

    @property
    def makespan_us(self) -> float:
        return float(self.finish_us.max()) if len(self.finish_us) else 0.0


def schedule_tasks(costs: list[TaskCost], waits: list[list[tuple[int, int, bool]]],
                   signals: list[list[int]], num_sms: int,
                   model: CostModel = CostModel()) -> Schedule:
    n = len(costs)
    sm_free = np.zeros(num_sms)
    busy = np.zeros(num_sms)
    counter_done = {}  # counter -> latest finish time of its producers so far (this step)
    sm_of = np.zeros(n, dtype=np.int64)
    start = np.zeros(n)
    finish = np.zeros(n)
    for t in range(n):
        ready = 0.0
        for c, _, prev in waits[t]:
            if not prev:
                ready = max(ready, counter_done.get(c, 0.0) + model.handoff_us)
        w_us = model.weight_us(costs[t], num_sms)
        a_us = model.act_us(costs[t], num_sms) + model.task_overhead_us
        p_us = model.prologue_us(costs[t])
        done = np.maximum(sm_free + w_us, np.maximum(sm_free + p_us, ready) + a_us)
        sm = int(np.argmin(done + 1e-9 * busy))
        sm_of[t] = sm
        start[t] = max(sm_free[sm], ready)
        finish[t] = done[sm]
        busy[sm] += finish[t] - sm_free[sm] if ready <= sm_free[sm] else w_us + a_us
        sm_free[sm] = finish[t]
        for c in signals[t]:
            counter_done[c] = max(counter_done.get(c, 0.0), finish[t])
    return Schedule(sm_of, start, finish, busy)
