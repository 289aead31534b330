"""scripts/probe_stream.py (a GPU probe) keeps compiling: its dry run builds every
configuration's plan and kernel source with the patched page constants, and restores them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mpk.backends.cuda import codegen
from mpk.tasks import base

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "probe_stream.py"


def test_the_probe_dry_run_renders_every_configuration() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 8 and "32 KB pages: 132 tasks, 6 pages" in done.stdout


def test_the_page_patch_is_undone() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import probe_stream
    finally:
        sys.path.remove(str(SCRIPT.parent))
    before = (base.PAGE_BYTES, codegen.PAGE_BYTES, codegen.MAX_PAGES)
    with probe_stream.page_config(32 * 1024, 5):
        assert (base.PAGE_BYTES, codegen.MAX_PAGES) == (32 * 1024, 5)
    assert (base.PAGE_BYTES, codegen.PAGE_BYTES, codegen.MAX_PAGES) == before


PHASES_SCRIPT = SCRIPT.parent / "probe_phases.py"


def test_every_phase_probe_patch_still_applies() -> None:
    """probe_phases.py patches the linear kind and runtime headers by anchor text: a kernel edit
    that moves an anchor must fail here, not on the GPU. (Its nvcc builds are checked by hand.)"""
    done = subprocess.run([sys.executable, str(PHASES_SCRIPT), "--dry-run"], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loader: ['launch.cuh', 'params.cuh', 'ptx.cuh', 'runtime.cuh'" in done.stdout
    assert len(done.stdout.strip().splitlines()) == 14


def test_every_model_probe_patch_still_applies() -> None:
    """scripts/probe_model.py reuses probe_phases' patches on a model's plan: they still apply."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from probe_model import RUNS
    finally:
        sys.path.remove(str(SCRIPT.parent))
    done = subprocess.run([sys.executable, str(SCRIPT.parent / "probe_model.py"), "--dry-run",
                           "--all"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pagewait: ['launch.cuh', 'linear/sm90.cuh'" in done.stdout
    assert len(done.stdout.strip().splitlines()) == len(RUNS)  # every run's patches apply
