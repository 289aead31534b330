"""Where a step's time goes along its dependency chain: one row per op role (the op name with
its layer index replaced by '*'), averaged over layers and steps.

A decode step is a chain of ops (embed, then per layer qkv -> attention -> o_proj -> gate_up ->
down, then lm_head, sample), and each op waits for the one before it. For one op in one step
the PHASE is the time from the previous op's last END to this op's last END: what the op adds
to the step. Its CRITICAL task (the one whose END is last) splits the phase into:
  handoff   previous op's last END -> the critical task's READY (the signal travels, the
            controller's poll sees it),
  queue     READY -> RUN (the consumers were still busy with an earlier record),
  input     RUN -> INPUT mark (linear: x staged from L2 and normalised; attention: its queries,
            keys and values prepared),
  compute   INPUT -> COMPUTE mark (linear: warp 0's weight walk of its last block; attention:
            every warp's positions attended, before the warps' merge),
  epilogue  COMPUTE -> DONE (outputs written, the task's last barrier),
  signal    DONE -> END (the storer's fence and counter adds).
A phase can exceed the sum when the critical task became ready before the previous op's last
END (it waited on an earlier op, not the last one) and started late anyway; the row keeps the
measured phase, so its columns need not add up exactly. Kinds that set no marks count their
whole body as compute.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mpk.profile.timeline import Timeline

PARTS = ("handoff", "queue", "input", "compute", "epilogue", "signal")
_LAYER = re.compile(r"\.\d+\.")


@dataclass(frozen=True)
class PhaseRow:
    role: str
    count: int  # (op, step) instances averaged
    phase_us: float
    parts_us: dict[str, float]  # PARTS -> mean microseconds on the critical task
    tasks: float  # tasks of the op per step
    mean_body_us: float  # mean RUN -> DONE over all its tasks

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def role_of(op_name: str) -> str:
    return _LAYER.sub(".*.", op_name, count=1)


def phase_rows(tl: Timeline) -> list[PhaseRow]:
    """One row per op role, in plan order of first appearance."""
    if len(tl) == 0:
        return []
    nops = len(tl.plan.ops)
    key = tl.step * nops + tl.op
    order = np.lexsort((tl.end_ns, key))  # by (step, op), the last END last
    last = np.r_[np.nonzero(np.diff(key[order]))[0], len(order) - 1]
    crit = order[last]  # the critical task of each (step, op), in (step, op) order
    step, op = tl.step[crit], tl.op[crit]
    chained = np.r_[False, step[1:] == step[:-1]]  # an earlier op of the same step exists
    prev_end = np.r_[0, tl.end_ns[crit][:-1]]
    marks = np.stack([prev_end, tl.seen_ns[crit], tl.ready_ns[crit], tl.input_ns[crit],
                      tl.compute_ns[crit], tl.done_ns[crit], tl.end_ns[crit]], axis=1)
    parts = np.maximum(np.diff(marks.astype(np.float64), axis=1), 0.0) / 1e3
    phase = (tl.end_ns[crit] - prev_end).astype(np.float64) / 1e3
    tasks = np.bincount(tl.op, minlength=nops) / max(tl.num_steps, 1)
    body = np.bincount(tl.op, weights=(tl.done_ns - tl.ready_ns).astype(np.float64),
                       minlength=nops) / 1e3
    role_ops: dict[str, list[int]] = {}
    for o, name in enumerate(o.name for o in tl.plan.ops):
        role_ops.setdefault(role_of(name), []).append(o)
    rows = []
    for role, members in role_ops.items():
        sel = chained & np.isin(op, members)
        if not sel.any():
            continue
        ran = tasks[members].sum() * max(tl.num_steps, 1)
        rows.append(PhaseRow(
            role, int(sel.sum()), float(phase[sel].mean()),
            dict(zip(PARTS, map(float, parts[sel].mean(axis=0)))),
            float(tasks[members].mean()), float(body[members].sum() / max(ran, 1))))
    return rows


def chain_us_per_step(rows: list[PhaseRow], num_steps: int) -> float:
    """Every role's phase times its count, per step: the chain's length."""
    return sum(r.phase_us * r.count for r in rows) / max(num_steps, 1)


def phases_json(rows: list[PhaseRow], num_steps: int) -> dict[str, Any]:
    """The rows and the chain's length per step."""
    return {"rows": [r.to_json() for r in rows],
            "chain_us_per_step": chain_us_per_step(rows, num_steps),
            "parts": list(PARTS), "doc": __doc__}


def render_phases(rows: list[PhaseRow], num_steps: int) -> Any:
    """A rich Table of the rows."""
    from rich.table import Table

    per_step = chain_us_per_step(rows, num_steps)
    t = Table(title=f"dependency chain per op role: {per_step:.1f} us per step, mean us over "
                    f"layers and steps (mpk/profile/phases.py)", title_justify="left")
    for i, name in enumerate(("op", "per step", "tasks", "phase", *PARTS, "mean body")):
        t.add_column(name, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(r.role, f"{r.count / max(num_steps, 1):.0f}", f"{r.tasks:.0f}",
                  f"{r.phase_us:.2f}", *(f"{r.parts_us[p]:.2f}" for p in PARTS),
                  f"{r.mean_body_us:.2f}")
    return t
