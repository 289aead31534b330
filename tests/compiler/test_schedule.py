"""The list scheduler's placement: a task's prologue (TaskCost.prologue_round_trips) runs once
its SM is free, so a task with one goes to an SM that is free early, not behind its producer."""

from __future__ import annotations

import numpy as np

from mpk.compiler import record
from mpk.compiler.lower import compile_graph
from mpk.compiler.schedule import CostModel, schedule_tasks
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import get_preset
from mpk.tasks.base import TaskCost

MODEL = CostModel()


def _chain(prologue_round_trips: int) -> np.ndarray:
    """Three tasks on two SMs: t0 (8 us in the model), t1 waiting for t0, t2 waiting for t1.
    t1 goes to the idle SM 1 (ready at 10 us, done 14, 4 us busy); when t2 is placed both SMs
    are free before its producers are done (SM 0 at 8 us, 8 us busy; SM 1 at 14 us)."""
    costs = [TaskCost(0, 0, 0, round_trips=2), TaskCost(0, 0, 0),
             TaskCost(0, 0, 0, prologue_round_trips=prologue_round_trips)]
    waits = [[], [(0, 1, False)], [(1, 1, False)]]
    signals = [[0], [1], []]
    return schedule_tasks(costs, waits, signals, num_sms=2, model=MODEL).sm_of_task


def test_a_task_without_a_prologue_may_land_behind_its_producer() -> None:
    # Both SMs finish t2 at the same time in the model; the less busy one (t1's) wins the tie.
    assert _chain(0).tolist() == [0, 1, 1]


def test_a_prologue_sends_the_task_to_the_sm_free_early_enough() -> None:
    # SM 1 frees at 14 us, its 4 us prologue would end at 18, after t1's result is ready (16):
    # SM 0 (free at 8) runs the prologue while t1 still works.
    assert MODEL.prologue_us(TaskCost(0, 0, 0, prologue_round_trips=2)) == 2 * MODEL.round_trip_us
    assert _chain(2).tolist() == [0, 1, 0]


def test_used_kv_splits_are_not_all_behind_their_sms_qkv_task() -> None:
    """qwen3-0.6b at batch 1 compiled for 2,048 positions has 16 KV splits a KV head; at a
    short context only split 0 works. Placed as 1/16 of the attention (no prologue term), all 8
    of a layer's split-0 tasks sat right behind their SM's own qkv task, their prologues on the
    critical path (+1.8% a token on an H100: docs/perf-log.md, forty-fourth session). Now at
    most half do, as in the one-split plan (4 SMs run no qkv task: 128 tasks on 132 SMs)."""
    plan = compile_graph(build_graph(get_preset("qwen3-0.6b"),
                                     DecodeShape(batch=1, max_pages=128, num_pages=128)), 132)
    names = [op.name for op in plan.ops]
    for layer in (3, 20):
        attention = names.index(f"layers.{layer}.attention")
        qkv = names.index(f"layers.{layer}.qkv")
        behind_qkv = used = 0
        for sm in range(plan.num_sms):
            rec = plan.instrs[sm, : plan.lengths[sm]]
            for i in np.nonzero(rec[:, record.OP] == attention)[0]:
                if rec[i, record.POINT + 2] == 0:  # split 0
                    used += 1
                    behind_qkv += int(i > 0 and rec[i - 1, record.OP] == qkv)
        assert used == 8 and behind_qkv <= 4, (layer, behind_qkv)
