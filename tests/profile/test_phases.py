"""The dependency-chain table (mpk.profile.phases) on fabricated stamps of a real plan."""

from __future__ import annotations

import numpy as np

from mpk.profile.phases import PARTS, phase_rows, phases_json, render_phases, role_of
from mpk.profile.timeline import Timeline
from tests.profile.conftest import STEPS
from tests.profile.synthetic import SEEN_NS, SIGNAL_NS


def test_roles_fold_layers() -> None:
    assert role_of("layers.12.gate_up") == "layers.*.gate_up"
    assert role_of("lm_head") == "lm_head"


def test_phases_add_up_to_the_chain(timeline: Timeline) -> None:
    rows = phase_rows(timeline)
    ops = [o.name for o in timeline.plan.ops]
    # Every op but each step's first appears once per step, under its role.
    assert sum(r.count for r in rows) == (len(ops) - 1) * STEPS
    # The phases telescope: their sum per step is the first op's last END to the last op's.
    first = np.array([timeline.end_ns[(timeline.step == s) & (timeline.op == 0)].max()
                      for s in range(STEPS)])
    last = np.array([timeline.end_ns[(timeline.step == s) & (timeline.op == len(ops) - 1)].max()
                     for s in range(STEPS)])
    chain = phases_json(rows, STEPS)["chain_us_per_step"]
    assert np.isclose(chain, float((last - first).mean()) / 1e3)


def test_parts_of_the_critical_task(timeline: Timeline) -> None:
    rows = {r.role: r for r in phase_rows(timeline)}
    for r in rows.values():
        parts = r.parts_us
        assert set(parts) == set(PARTS) and min(parts.values()) >= 0.0
        # Only the handoff is clipped (a critical task that waited on an earlier op): the parts
        # never fall short of the phase.
        assert sum(parts.values()) >= r.phase_us - 1e-9
        assert np.isclose(parts["queue"], SEEN_NS / 1e3)
        assert np.isclose(parts["signal"], SIGNAL_NS / 1e3)
    linear = rows["layers.*.o_proj"].parts_us
    assert linear["input"] > 0 and linear["epilogue"] > 0  # marked at 30% and 70% of the body
    attention = rows["layers.*.attention"].parts_us
    assert attention["input"] == 0 and attention["epilogue"] == 0  # no marks: all compute


def test_render(timeline: Timeline) -> None:
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(render_phases(phase_rows(timeline), STEPS))
    text = console.export_text()
    assert "layers.*.gate_up" in text and "handoff" in text
