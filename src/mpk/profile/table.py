"""Per task kind: how often it ran, how long, how long the slowest SM spent on it, and how close
it came to the bandwidth it is entitled to.

Bytes come from the kinds' cost model (get_kind(kind).cost(plan.op_view(op)): weight plus
activation bytes of one task), the same numbers the scheduler plans with. A task's load and its
compute overlap inside the task, and the stamps only bracket the whole task, so "load-bound" is
derived: a kind whose tasks move their bytes at >= LOAD_BOUND_PCT of one SM's share of the HBM
bandwidth (bandwidth / num_sms) while they run is bound by loading; below that, by latency or
compute. The caption (CAPTION) says the same next to the numbers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mpk.compiler.schedule import CostModel
from mpk.profile.timeline import Timeline
from mpk.tasks.registry import get_kind

LOAD_BOUND_PCT = 50.0
ALL = "all kinds"
CAPTION = (
    "run = the task (RUN..END stamps): loading and computing overlap inside a task and are not "
    "separated without kernel changes. wait = on dependency counters before it (WAIT..RUN, incl. "
    "issuing the next record's L2 prefetch). slowest SM = per step, the largest per-SM sum of the "
    "kind's run time (mean over steps). bytes = the kinds' cost model (weights + activations; "
    "attention assumes 1k positions). GB/s/SM = bytes / run time; % share = of one SM's share of "
    f"the HBM bandwidth (bandwidth / SMs); bound 'load' when >= {LOAD_BOUND_PCT:.0f}%. floor = "
    "bytes per step / the whole GPU's bandwidth.")


@dataclass(frozen=True)
class KindRow:
    kind: str
    tasks: int  # records executed in the launch (tasks per step x steps)
    tasks_per_step: float
    total_run_us: float
    mean_run_us: float
    slowest_sm_us: float  # per step: max over SMs of the kind's summed run time; mean of steps
    total_wait_us: float
    wait_share: float  # wait / (wait + run), 0..1
    bytes_per_step: float
    floor_us: float  # bytes_per_step at the whole GPU's bandwidth
    gbps_per_sm: float  # bytes / run time while the kind's tasks run (GB/s)
    pct_of_sm_share: float  # gbps_per_sm against bandwidth / num_sms
    bound: str  # "load" or "latency/compute"


@dataclass(frozen=True)
class KindTable:
    rows: list[KindRow]  # by total run time, largest first
    total: KindRow  # every kind together
    bandwidth_bytes_per_s: float
    num_sms: int
    num_steps: int
    us_per_step: float  # the launch's span from the stamps / steps

    def to_json(self) -> dict[str, Any]:
        return {"rows": [asdict(r) for r in self.rows], "total": asdict(self.total),
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s, "num_sms": self.num_sms,
                "num_steps": self.num_steps, "us_per_step": self.us_per_step,
                "load_bound_pct": LOAD_BOUND_PCT, "caption": CAPTION}


def op_task_bytes(tl: Timeline) -> np.ndarray:
    """Bytes one task of each op moves (cost model: weight + activation bytes), float [ops]."""
    out = np.zeros(len(tl.plan.ops), dtype=np.float64)
    for i, op in enumerate(tl.plan.ops):
        cost = get_kind(op.kind).cost(tl.plan.op_view(i))
        out[i] = cost.weight_bytes + cost.act_bytes
    return out


def kind_table(tl: Timeline, bandwidth_bytes_per_s: float | None = None) -> KindTable:
    """The table for `tl`; `bandwidth_bytes_per_s`: the measured HBM read bandwidth (default:
    the scheduler's CostModel figure)."""
    bandwidth = float(bandwidth_bytes_per_s or CostModel().floor_bytes_per_us * 1e6)
    num_sms, steps = tl.plan.num_sms, max(tl.num_steps, 1)
    event_bytes = op_task_bytes(tl)[tl.op]
    run, wait = tl.run_ns.astype(np.float64), tl.wait_ns.astype(np.float64)
    rows = [_row(kind, tl.kind_id == k, tl, run, wait, event_bytes, bandwidth)
            for k, kind in enumerate(tl.plan.kinds) if (tl.kind_id == k).any()]
    rows.sort(key=lambda r: -r.total_run_us)
    total = _row(ALL, np.ones(len(tl), dtype=bool), tl, run, wait, event_bytes, bandwidth)
    return KindTable(rows, total, bandwidth, num_sms, steps, tl.ns_per_step / 1e3)


def _row(kind: str, sel: np.ndarray, tl: Timeline, run: np.ndarray, wait: np.ndarray,
         event_bytes: np.ndarray, bandwidth: float) -> KindRow:
    num_sms, steps = tl.plan.num_sms, max(tl.num_steps, 1)
    per_sm = np.zeros((steps, num_sms))
    np.add.at(per_sm, (tl.step[sel], tl.sm[sel]), run[sel])
    run_ns, wait_ns, nbytes = float(run[sel].sum()), float(wait[sel].sum()), float(
        event_bytes[sel].sum())
    tasks = int(sel.sum())
    gbps = nbytes / run_ns if run_ns > 0 else 0.0  # bytes per ns == GB/s
    pct = 100.0 * gbps * 1e9 / (bandwidth / num_sms)
    return KindRow(
        kind=kind, tasks=tasks, tasks_per_step=tasks / steps, total_run_us=run_ns / 1e3,
        mean_run_us=run_ns / 1e3 / max(tasks, 1),
        slowest_sm_us=float(per_sm.max(axis=1).mean()) / 1e3, total_wait_us=wait_ns / 1e3,
        wait_share=wait_ns / (wait_ns + run_ns) if wait_ns + run_ns > 0 else 0.0,
        bytes_per_step=nbytes / steps, floor_us=nbytes / steps / bandwidth * 1e6,
        gbps_per_sm=gbps, pct_of_sm_share=pct,
        bound="load" if pct >= LOAD_BOUND_PCT else "latency/compute")


def render_table(table: KindTable, title: str | None = None) -> Any:
    """A rich Table (print it with a rich Console)."""
    from rich.table import Table

    t = Table(title=title or f"per task kind: {table.num_steps} steps, "
                             f"{table.us_per_step:.1f} us/step on {table.num_sms} SMs, "
                             f"HBM {table.bandwidth_bytes_per_s / 1e12:.2f} TB/s",
              title_justify="left", caption=CAPTION, caption_justify="left")
    columns = ("kind", "tasks", "total run ms", "mean us", "slowest SM us/step",
               "floor us/step", "MB/step", "GB/s/SM", "% share", "bound", "wait %")
    for i, name in enumerate(columns):
        t.add_column(name, justify="left" if i in (0, 9) else "right")
    for r in [*table.rows, table.total]:
        t.add_row(r.kind, f"{r.tasks}", f"{r.total_run_us / 1e3:.3f}", f"{r.mean_run_us:.2f}",
                  f"{r.slowest_sm_us:.1f}", f"{r.floor_us:.1f}", f"{r.bytes_per_step / 1e6:.2f}",
                  f"{r.gbps_per_sm:.1f}", f"{r.pct_of_sm_share:.0f}%",
                  r.bound if r.kind != ALL else "", f"{100 * r.wait_share:.0f}%",
                  end_section=r is table.rows[-1])
    return t
