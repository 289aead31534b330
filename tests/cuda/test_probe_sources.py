"""The standalone CUDA probes in scripts/ (each one file, built and run by hand on the GPU as its
header says) still compile for sm_90a: a probe that rots fails here, not on the device's clock."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mpk import env

pytestmark = pytest.mark.nvcc
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
PROBES = sorted(SCRIPTS.glob("*.cu"))


def test_the_probes_are_found() -> None:
    assert {p.name for p in PROBES} >= {"handoff_bench.cu", "page_protocol_bench.cu",
                                        "racecheck_probe.cu", "stage_bench.cu"}


@pytest.mark.parametrize("source", PROBES, ids=lambda p: p.name)
def test_probe_compiles(source: Path, tmp_path: Path) -> None:
    cmd = [env.nvcc_path(), "-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a",
           "-diag-suppress", "128", "-o", str(tmp_path / source.stem), str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
