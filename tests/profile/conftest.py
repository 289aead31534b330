"""Fixtures: one small real Plan and fabricated stamps for it, shared by the profile tests."""

from __future__ import annotations

import numpy as np
import pytest

from mpk.compiler.plan import Plan
from mpk.profile.timeline import Timeline, from_stamps
from tests.profile.synthetic import fabricate_stamps, tiny_plan

STEPS = 3
STEP_BEGIN = 5


@pytest.fixture(scope="session")
def plan() -> Plan:
    return tiny_plan()


@pytest.fixture(scope="session")
def stamps(plan: Plan) -> np.ndarray:
    return fabricate_stamps(plan, STEPS)


@pytest.fixture()
def timeline(plan: Plan, stamps: np.ndarray) -> Timeline:
    return from_stamps(stamps, plan, STEP_BEGIN)
