"""Timeline -> Chrome/Perfetto trace, SM x time PNG, per-kind table, and the report folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from mpk.compiler.plan import Plan
from mpk.profile.picture import PNG_MAGIC, draw_timeline
from mpk.profile.run import KINDS_FILE, PICTURE_FILE, TRACE_FILE, write_reports
from mpk.profile.table import ALL, CAPTION, kind_table, op_task_bytes, render_table
from mpk.profile.timeline import Timeline
from mpk.profile.trace import WAIT_CATEGORY, write_trace
from tests.profile.conftest import STEPS


def test_trace_is_valid_chrome_json(plan: Plan, timeline: Timeline, tmp_path: Path) -> None:
    trace = json.loads(write_trace(timeline, tmp_path / "t.json").read_text())
    events = trace["traceEvents"]
    for e in events:
        assert {"ph", "ts", "pid", "tid"} <= set(e), e
        if e["ph"] == "X":
            assert e["dur"] >= 0
    tracks = {e["tid"]: e["args"]["name"] for e in events
              if e["ph"] == "M" and e["name"] == "thread_name"}
    assert tracks == {**{sm: f"SM {sm}" for sm in range(plan.num_sms)}, plan.num_sms: "steps"}
    tasks = [e for e in events if e["ph"] == "X" and e["cat"] in plan.kinds]
    assert len(tasks) == plan.num_tasks * STEPS
    op_names = {o.name for o in plan.ops}
    for e in tasks:
        assert e["name"].split("[")[0] in op_names and e["tid"] < plan.num_sms
        assert e["name"] == f"{e['args']['op']}{e['args']['point']}"
        assert {"kind", "task", "wait_us"} <= set(e["args"])
    waits = [e for e in events if e.get("cat") == WAIT_CATEGORY]
    assert len(waits) == int((timeline.wait_ns > 0).sum())
    steps = [e for e in events if e.get("cat") == "step"]
    assert sum(e["ph"] == "X" for e in steps) == STEPS == sum(e["ph"] == "i" for e in steps)
    total_run_us = sum(e["dur"] for e in tasks)
    assert total_run_us == pytest.approx(timeline.run_ns.sum() / 1e3, abs=1e-3 * len(tasks))


@pytest.mark.parametrize("engine", ["matplotlib", "raster"])
def test_picture_is_a_png(timeline: Timeline, tmp_path: Path, engine: str) -> None:
    if engine == "matplotlib":
        pytest.importorskip("matplotlib")
    path = draw_timeline(timeline, tmp_path / f"{engine}.png", engine=engine)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_kind_table_sums_match_the_timeline(plan: Plan, timeline: Timeline) -> None:
    table = kind_table(timeline, bandwidth_bytes_per_s=4e12)
    rows = table.rows
    assert {r.kind for r in rows} == set(plan.kinds)
    assert sum(r.tasks for r in rows) == len(timeline) == table.total.tasks
    run_us = timeline.run_ns.sum() / 1e3
    assert sum(r.total_run_us for r in rows) == pytest.approx(run_us)
    assert table.total.total_run_us == pytest.approx(run_us)
    assert sum(r.total_wait_us for r in rows) == pytest.approx(timeline.wait_ns.sum() / 1e3)
    assert [r.total_run_us for r in rows] == sorted((r.total_run_us for r in rows), reverse=True)
    per_task = op_task_bytes(timeline)
    step_bytes = sum(per_task[i] * np.prod(op.grid) for i, op in enumerate(plan.ops))
    assert table.total.bytes_per_step == pytest.approx(step_bytes)
    for r in rows:
        sel = timeline.kind_names() == r.kind
        assert r.tasks_per_step == pytest.approx(sel.sum() / STEPS)
        assert r.mean_run_us == pytest.approx(timeline.run_ns[sel].mean() / 1e3)
        # slowest SM: per step the busiest SM's sum for this kind, averaged over the steps
        per_step = [max(timeline.run_ns[sel & (timeline.step == s) & (timeline.sm == sm)].sum()
                        for sm in range(plan.num_sms)) for s in range(STEPS)]
        assert r.slowest_sm_us == pytest.approx(np.mean(per_step) / 1e3)
        assert r.slowest_sm_us <= r.total_run_us / STEPS + 1e-9
        assert 0.0 <= r.wait_share <= 1.0
        share = 4e12 / plan.num_sms
        assert r.pct_of_sm_share == pytest.approx(100 * r.gbps_per_sm * 1e9 / share)
        assert r.bound == ("load" if r.pct_of_sm_share >= 50 else "latency/compute")
    console = Console(record=True, width=220, color_system=None)
    console.print(render_table(table))
    text = console.export_text()
    assert all(k in text for k in plan.kinds) and ALL in text and "GB/s/SM" in text
    assert CAPTION.split()[0] in text


def test_write_reports(timeline: Timeline, tmp_path: Path) -> None:
    out = tmp_path / "prof"
    table, summary = write_reports(timeline, out, extra={"model": "tiny-llama"})
    assert (out / PICTURE_FILE).read_bytes().startswith(PNG_MAGIC)
    assert json.loads((out / TRACE_FILE).read_text())["traceEvents"]
    saved = json.loads((out / KINDS_FILE).read_text())
    assert saved == json.loads(json.dumps(summary))  # plain JSON types, nothing stringified
    assert saved["model"] == "tiny-llama" and saved["events"] == len(timeline)
    assert saved["kinds"]["total"]["tasks"] == table.total.tasks == len(timeline)
    assert saved["stamps_ms_per_step"] == pytest.approx(timeline.ns_per_step / 1e6)


def test_reports_window_the_trace_not_the_table(timeline: Timeline, tmp_path: Path) -> None:
    table, summary = write_reports(timeline, tmp_path, window_steps=1)
    trace = json.loads((tmp_path / TRACE_FILE).read_text())["traceEvents"]
    tasks = [e for e in trace if e["ph"] == "X" and e["cat"] in timeline.plan.kinds]
    assert len(tasks) == timeline.plan.num_tasks and {e["args"]["step"] for e in tasks} == {0}
    assert table.total.tasks == len(timeline) and summary["window_steps"] == 1
