"""The watchdog's post-mortem (CPU only): root cause vs CTAs that merely waited behind it."""

from __future__ import annotations

import numpy as np

from mpk.backends.cuda import codegen, diagnose
from mpk.compiler import record
from tests.cuda.runtime_plans import chain_plan, patch_record

TILES, SMS = 64, 32


def state(rows: dict[int, tuple[int, int, int, int]]) -> np.ndarray:
    out = np.zeros((SMS, codegen.SM_STATE_WORDS), dtype=np.int32)
    f = codegen.SM_STATE_FIELDS
    for sm, (status, index, step, wait) in rows.items():
        out[sm, [f["STATUS"], f["INDEX"], f["STEP"], f["WAIT"]]] = (status, index, step, wait)
    return out


def test_root_is_the_impossible_wait_not_its_victims() -> None:
    plan = chain_plan(n=TILES * 16, tiles=TILES, num_sms=SMS)
    stuck = TILES + 3  # inc1[3]: task 67, SM 3, position 2 (round-robin dealing)
    plan = patch_record(plan, stuck, record.WAITS + 1, 1 << 30)
    assert plan.locate(stuck) == (3, 2)
    waiting = codegen.SM_STATUS["WAITING"]
    # Every other SM reached its first inc2 task (position 4) and waits on counter 1.
    rows = {sm: (waiting, 4, 0, 0) for sm in range(SMS) if sm != 3}
    rows[3] = (waiting, 2, 0, 0)
    counters = np.array([TILES, TILES - 1, 0], dtype=np.int64)
    text = diagnose.explain(plan, state(rows), counters, step_begin=5)
    first = text.splitlines()[0]
    assert first.startswith("root cause: task 67 inc1[3, 0, 0] on SM 3"), text
    assert "global step 5" in first and f"needs {6 << 30}" in first and "counter 0" in first
    assert "inc0[0, 0, 0]" in first  # names the counter's producers
    assert f"{SMS - 1} other SM(s)" in text


def test_cycle_is_reported_as_deadlock() -> None:
    plan = chain_plan(n=TILES * 16, tiles=TILES, num_sms=SMS)
    # Break the schedule: inc0[0] (SM 0, position 0) waits on inc1 of the same step, which
    # waits on all of inc0: a cycle no root explains.
    plan = patch_record(plan, 0, record.WAITS, 1)
    plan = patch_record(plan, 0, record.WAITS + 2, 0)
    waiting = codegen.SM_STATUS["WAITING"]
    rows = {0: (waiting, 0, 0, 0), 1: (waiting, 2, 0, 0)}  # SM 1 at inc1[1], waiting counter 0
    text = diagnose.explain(plan, state(rows), np.zeros(3, dtype=np.int64), step_begin=0)
    assert text.startswith("no root cause"), text
    assert "inc0[0, 0, 0] on SM 0" in text and "inc1[1, 0, 0] on SM 1" in text


def test_a_poll_that_skipped_no_wait_is_a_root_without_a_counter() -> None:
    plan = chain_plan(n=TILES * 16, tiles=TILES, num_sms=SMS)
    poll, waiting = codegen.SM_STATUS["POLL"], codegen.SM_STATUS["WAITING"]
    # SM 3 gave up polling at inc1[3] (position 2) with no skipped wait to name (wait -1); the
    # others wait on counter 1, which that task would have signalled.
    rows = {sm: (waiting, 4, 0, 0) for sm in range(SMS) if sm != 3}
    rows[3] = (poll, 2, 0, -1)
    counters = np.array([TILES, TILES - 1, 0], dtype=np.int64)
    text = diagnose.explain(plan, state(rows), counters, step_begin=0)
    first = text.splitlines()[0]
    assert first.startswith("root cause: task 67 inc1[3, 0, 0] on SM 3"), text
    assert "polled flagged data that never carried the epoch it expects" in first, text
    assert "counter" not in first, text


def test_a_poll_that_skipped_a_wait_names_its_producers() -> None:
    plan = chain_plan(n=TILES * 16, tiles=TILES, num_sms=SMS)
    poll = codegen.SM_STATUS["POLL"]
    rows = {3: (poll, 2, 0, 0)}  # inc1[3] polled the data of counter 0's producers (all done)
    counters = np.array([TILES, 0, 0], dtype=np.int64)
    text = diagnose.explain(plan, state(rows), counters, step_begin=0)
    assert "polled its flagged input from the tasks that signal counter 0" in text, text
    assert "the epochs their writes carry are not the ones it reads" in text, text
