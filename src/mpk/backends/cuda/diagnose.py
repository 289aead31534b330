"""Explains a watchdog stop: which stopped wait is the root cause, which merely waited behind it.

After a failure every CTA has recorded where it stopped (codegen.SM_STATE_FIELDS): the record
position and local step, and which of its waits it was spinning on; a CTA that finished its
whole list recorded nothing. Because each SM runs its list in order, that tells exactly which
tasks completed. A stopped wait is a ROOT when every producer of its counter for the needed
step has completed (yet the counter is short: a wrong count or a missing signal). Otherwise it
is a VICTIM, waiting for a producer that is itself stopped; following producers from victims
either reaches a root or closes a cycle (a schedule deadlock).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpk.compiler import record
from mpk.compiler.plan import Plan

from . import codegen


@dataclass(frozen=True)
class Stop:
    sm: int
    index: int  # position in the SM's list
    step: int  # local step
    status: int  # codegen.SM_STATUS value
    wait: int  # wait slot, -1 when not waiting
    task: int
    counter: int
    needed_step: int  # local step of the producers this wait needs (may be < 0: done before)
    target: int


def stops(plan: Plan, sm_state: np.ndarray, step_begin: int) -> dict[int, Stop]:
    """The stopped CTAs by SM."""
    f = codegen.SM_STATE_FIELDS
    out: dict[int, Stop] = {}
    for sm in range(plan.num_sms):
        row = sm_state[sm]
        status = int(row[f["STATUS"]])
        if status == 0:
            continue
        index, step, wait = int(row[f["INDEX"]]), int(row[f["STEP"]]), int(row[f["WAIT"]])
        rec = plan.instrs[sm, index]
        counter, needed, target = -1, step, 0
        if wait >= 0:
            c, count, prev = record.decode_waits(rec)[wait]
            counter, needed = c, step - prev
            target = record.wait_target(count, prev, step_begin + step)
        out[sm] = Stop(sm, index, step, status, wait, int(rec[record.TASK]), counter, needed,
                       target)
    return out


def producers(plan: Plan, counter: int) -> list[tuple[int, int, int]]:
    """(sm, position, task) of every record that signals `counter`."""
    out = []
    for sm in range(plan.num_sms):
        for j in range(int(plan.lengths[sm])):
            rec = plan.instrs[sm, j]
            if counter in record.decode_signals(rec):
                out.append((sm, j, int(rec[record.TASK])))
    return out


def pending(plan: Plan, stopped: dict[int, Stop], stop: Stop) -> list[tuple[int, int]]:
    """(sm, task) of producers `stop` waits for that never completed."""
    if stop.wait < 0 or stop.needed_step < 0:
        return []
    out = []
    for sm, j, task in producers(plan, stop.counter):
        s = stopped.get(sm)
        if s is not None and (stop.needed_step, j) >= (s.step, s.index):
            out.append((sm, task))
    return out


def explain(plan: Plan, sm_state: np.ndarray, counters: np.ndarray, step_begin: int) -> str:
    """A human account of the stop; empty when no CTA recorded a stop."""
    stopped = stops(plan, sm_state, step_begin)
    if not stopped:
        return ""

    def describe(s: Stop) -> str:
        where = f"task {s.task} {plan.task_name(s.task)} on SM {s.sm}"
        if s.status == codegen.SM_STATUS["BAD_KIND"]:
            return f"{where} has an unknown kind id"
        if s.status == codegen.SM_STATUS["POLL"]:
            head = f"{where} (position {s.index}) at global step {step_begin + s.step} polled"
            if s.counter < 0:
                return f"{head} flagged data that never carried the epoch it expects"
            return (f"{head} its flagged input from the tasks that signal counter {s.counter} "
                    f"and never saw the epoch it expects (counter value "
                    f"{int(counters[s.counter])}, needs {s.target})")
        if s.status == codegen.SM_STATUS["PEER"]:
            return (f"{where} (position {s.index}) at global step {step_begin + s.step} stopped "
                    f"in its wait for the other tensor-parallel GPUs' partials")
        return (f"{where} (position {s.index}) at global step {step_begin + s.step} waits for "
                f"counter {s.counter}: value {int(counters[s.counter])}, needs {s.target}")

    lines = []
    roots = [s for s in stopped.values() if not pending(plan, stopped, s)]
    for s in roots:
        why = ("" if s.status in (codegen.SM_STATUS["BAD_KIND"], codegen.SM_STATUS["PEER"])
               or s.counter < 0 else
               f"; every task that signals counter {s.counter} for that step "
               f"({_names(plan, s.counter)}) has finished, so "
               + ("the epochs their writes carry are not the ones it reads (flag entries)"
                  if s.status == codegen.SM_STATUS["POLL"] else
                  "the wait's count or the counter's signals are wrong"))
        lines.append(f"root cause: {describe(s)}{why}")
    if not roots:
        lines.append("no root cause: the stopped waits wait on each other (a schedule "
                     "deadlock):")
        lines += [f"  {describe(s)}; blocked by tasks "
                  f"{[plan.task_name(t) for _, t in pending(plan, stopped, s)][:4]}"
                  for s in list(stopped.values())[:8]]
    victims = len(stopped) - len(roots)
    if roots and victims:
        lines.append(f"{victims} other SM(s) stopped while waiting behind it")
    return "\n".join(lines)


def _names(plan: Plan, counter: int, limit: int = 4) -> str:
    tasks = [task for _, _, task in producers(plan, counter)]
    if not tasks:
        return "none"
    more = f" and {len(tasks) - limit} more" if len(tasks) > limit else ""
    return ", ".join(plan.task_name(t) for t in tasks[:limit]) + more
