"""scripts/ncu_walk.py --summarize reads ncu's exported source page (CPU only): a fabricated
export in ncu's CSV layout must give the sample totals and the hottest instructions in order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ncu_walk.py"

EXPORT = '''"Kernel Name","mpk_megakernel",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","# Samples","Instructions Executed"
"0x7f0000000000","      LDC R1, c[0x0][0x28]","22","21","22","1,584"
"0x7f0000000010","@P0   BRA 0x7f0000000000","5,990","5,000","5,990","2,000"
"0x7f0000000020","      HMMA.16816.F32.BF16 R4, R8, R12, R4","300","100","300","9,000"
'''


def test_summary_orders_instructions_by_samples(tmp_path: Path) -> None:
    export = tmp_path / "walk_sass.csv"
    export.write_text(EXPORT)
    done = subprocess.run([sys.executable, str(SCRIPT), "--summarize", str(export), "--top", "2"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "'Warp Stall Sampling (All Samples)': 6312.0" in out  # thousands separators read
    hot = out.split("hottest instructions:")[1].strip().splitlines()
    assert len(hot) == 2
    assert hot[0].split()[0] == "5990" and "BRA" in hot[0]
    assert hot[1].split()[0] == "300" and "HMMA" in hot[1]
