"""scripts/load_chains.py (CPU only) finds global loads read before their basic block ends: a
fabricated nvdisasm listing with line info must give exactly the chains it holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "load_chains.py"

LISTING = '''
	//## File "/x/src/mpk/tasks/attention/sm90.cuh", line 119
        /*0010*/                   LDG.E.U16.STRONG.GPU R30, desc[UR14][R30.64] ;
	//## File "/x/src/mpk/tasks/common/memory.cuh", line 61
        /*0020*/                   IMAD.U32 R103, R30, 0x10000, RZ ;
        /*0030*/                   LDG.E.U16.STRONG.GPU R31, desc[UR14][R40.64] ;
        /*0040*/                   BSYNC B1 ;
        /*0050*/                   IMAD.U32 R104, R31, 0x10000, RZ ;
        /*0060*/                   LDG.E.NA.LTC256B.128.CONSTANT R60, desc[UR16][R28.64] ;
        /*0070*/                   FFMA R1, R60, R2, R1 ;
        /*0080*/               @P1 LDG.E.STRONG.GPU R50, desc[UR14][R44.64] ;
        /*0090*/                   IMAD.MOV.U32 R51, RZ, RZ, R52 ;
	//## File "/x/src/mpk/tasks/linear/sm90.cuh", line 12
        /*00a0*/                   STS [R35], R50 ;
        /*00b0*/                   LDG.E.STRONG.GPU R7, desc[UR14][R8.64] ;
        /*00c0*/                   IMAD R70, R71, 0x4, R72 ;
'''


def test_lists_the_loads_read_inside_their_block(tmp_path: Path) -> None:
    listing = tmp_path / "k.sass"
    listing.write_text(LISTING)
    done = subprocess.run([sys.executable, str(SCRIPT), "--sass", str(listing)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # the shift after the first load, and the store of the predicated load's value; not the
    # shift past BSYNC, the weight (CONSTANT) load's use, or the load never read
    assert lines[0].startswith("2 global loads")
    assert sorted(line.split()[1] for line in lines[1:]) == ["common/memory.cuh:61",
                                                            "linear/sm90.cuh:12"]
