"""Raw stamps -> Timeline: every task x step exactly once, phases and names right."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from mpk.compiler import record
from mpk.compiler.plan import Plan
from mpk.errors import MpkError
from mpk.profile.timeline import Timeline, from_stamps
from tests.profile.conftest import STEP_BEGIN, STEPS
from tests.profile.synthetic import ORIGIN_NS


def test_every_task_and_step_once(plan: Plan, timeline: Timeline) -> None:
    assert len(timeline) == plan.num_tasks * STEPS and timeline.missing == 0
    seen = Counter(zip(timeline.task.tolist(), timeline.step.tolist()))
    assert set(seen) == {(t, s) for t in range(plan.num_tasks) for s in range(STEPS)}
    assert set(seen.values()) == {1}


def test_events_follow_the_plan(plan: Plan, timeline: Timeline) -> None:
    records = plan.records()
    events = timeline.events()
    assert len(events) == len(timeline)
    for e in events:
        rec = records[e.task]
        assert e.kind == plan.kinds[rec[record.KIND]]
        assert e.op == plan.ops[rec[record.OP]].name
        assert e.point == tuple(int(x) for x in rec[record.POINT:record.POINT + 3])
        assert (e.sm, e.index) == plan.locate(e.task)
        assert e.global_step == STEP_BEGIN + e.step
        assert e.wait_ns >= 0 and e.run_ns > 0
        assert e.start_ns + e.wait_ns + e.run_ns == e.end_ns
    assert events[0].name == plan.task_name(events[0].task)


def test_times_are_relative_to_the_first_stamp(stamps: np.ndarray, timeline: Timeline) -> None:
    assert timeline.origin_ns == int(stamps[..., 0][stamps[..., 0] > 0].min()) == ORIGIN_NS
    assert timeline.start_ns.min() == 0
    assert timeline.span_ns == int(stamps[..., 2].max()) - ORIGIN_NS
    assert timeline.ns_per_step == pytest.approx(timeline.span_ns / STEPS)
    spans = timeline.step_spans()
    assert spans.shape == (STEPS, 2) and (spans[:, 0] < spans[:, 1]).all()
    assert (np.diff(spans[:, 0]) > 0).all()  # steps begin in order
    assert timeline.timer_resolution_ns() >= 1


def test_records_per_sm_run_in_list_order(timeline: Timeline) -> None:
    for sm in range(timeline.plan.num_sms):
        sel = timeline.sm == sm
        order = np.lexsort((timeline.index[sel], timeline.step[sel]))
        starts = timeline.start_ns[sel][order]
        assert (np.diff(starts) > 0).all()


def test_missing_and_malformed_stamps(plan: Plan, stamps: np.ndarray) -> None:
    cut = stamps.copy()
    cut[2, 3, 4:] = 0  # SM 3 stopped in the last step
    tl = from_stamps(cut, plan)
    assert tl.missing == int(plan.lengths[3]) - 4
    assert len(tl) == plan.num_tasks * STEPS - tl.missing
    with pytest.raises(MpkError, match="no stamps"):
        from_stamps(np.zeros_like(stamps), plan)
    with pytest.raises(MpkError, match="do not fit the plan"):
        from_stamps(stamps[:, :4], plan)
    # uint64 (the device's type) works as well as int64
    assert len(from_stamps(stamps.astype(np.uint64), plan)) == len(tl) + tl.missing


def test_first_steps_window(timeline: Timeline) -> None:
    window = timeline.first_steps(2)
    assert window.num_steps == 2 and set(window.step.tolist()) == {0, 1}
    assert len(window) == int((timeline.step < 2).sum())
    assert window.origin_ns == timeline.origin_ns and window.start_ns.min() == 0
    assert timeline.first_steps(STEPS) is timeline
