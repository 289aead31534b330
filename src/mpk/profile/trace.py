"""A Timeline as a Chrome trace (JSON), which Perfetto (ui.perfetto.dev) and chrome://tracing open.

One process ("MPK megakernel"), one thread track per SM named "SM n", then a "steps" track.
Each task is a complete event ("ph": "X") named by its op and grid point, spanning the task
itself (RUN..END); the time it waited on counters before (WAIT..RUN) is a separate "wait" slice
on the same track, so idle SMs show as wait rather than as gaps. Step boundaries: one slice per
step on the "steps" track plus a global instant event where each step begins. Timestamps are in
microseconds (the format's unit) with nanosecond decimals.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mpk.profile.timeline import Timeline

PID = 1
WAIT_NAME = "wait"
WAIT_CATEGORY = "wait"


def _us(ns: float) -> float:
    return round(float(ns) / 1e3, 3)


def chrome_trace(tl: Timeline, *, waits: bool = True, title: str | None = None) -> dict[str, Any]:
    """The trace as a dict ({"traceEvents": [...], ...}); json.dump it, or use write_trace.
    `waits`: add the wait slices (about doubles the event count)."""
    steps_tid = tl.plan.num_sms
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "ts": 0, "pid": PID, "tid": 0,
         "args": {"name": title or "MPK megakernel"}},
    ]
    for sm in range(tl.plan.num_sms):
        events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": PID, "tid": sm,
                       "args": {"name": f"SM {sm}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": PID, "tid": sm,
                       "args": {"sort_index": sm}})
    events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": PID, "tid": steps_tid,
                   "args": {"name": "steps"}})
    events.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": PID,
                   "tid": steps_tid, "args": {"sort_index": -1}})  # steps above the SMs

    for s, (begin, end) in enumerate(tl.step_spans()):
        g = tl.step_begin + s
        events.append({"name": f"step {g}", "cat": "step", "ph": "X", "ts": _us(begin),
                       "dur": _us(end - begin), "pid": PID, "tid": steps_tid,
                       "args": {"local_step": s, "global_step": g}})
        events.append({"name": f"step {g} begins", "cat": "step", "ph": "i", "s": "g",
                       "ts": _us(begin), "pid": PID, "tid": steps_tid})

    wait_ns, run_ns = tl.wait_ns, tl.run_ns
    kinds, ops = tl.plan.kinds, [o.name for o in tl.plan.ops]
    for e in range(len(tl)):
        sm, kind, op = int(tl.sm[e]), kinds[tl.kind_id[e]], ops[tl.op[e]]
        point = [int(x) for x in tl.point[e]]
        step = int(tl.step[e])
        if waits and wait_ns[e] > 0:
            events.append({"name": WAIT_NAME, "cat": WAIT_CATEGORY, "ph": "X",
                           "ts": _us(tl.start_ns[e]), "dur": _us(wait_ns[e]), "pid": PID,
                           "tid": sm, "args": {"before": f"{op}{point}", "step": step}})
        events.append({"name": f"{op}{point}", "cat": kind, "ph": "X",
                       "ts": _us(tl.ready_ns[e]), "dur": _us(run_ns[e]), "pid": PID, "tid": sm,
                       "args": {"kind": kind, "op": op, "point": point, "task": int(tl.task[e]),
                                "step": step, "global_step": tl.step_begin + step,
                                "index": int(tl.index[e]), "wait_us": _us(wait_ns[e]),
                                "run_us": _us(run_ns[e])}})
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"num_sms": tl.plan.num_sms, "num_steps": tl.num_steps,
                          "step_begin": tl.step_begin, "origin_globaltimer_ns": tl.origin_ns,
                          "missing_records": tl.missing}}


def write_trace(tl: Timeline, path: str | Path, **options: Any) -> Path:
    """Write chrome_trace(tl) as compact JSON to `path` (e.g. trace.json)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # dumps, not dump: json.dump streams through the pure-Python encoder (several times slower).
    path.write_text(json.dumps(chrome_trace(tl, **options), separators=(",", ":")))
    return path
