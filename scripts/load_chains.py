#!/usr/bin/env python
"""Global loads whose value is used before the next branch, in a megakernel's SASS (CPU only).

A load issued to run under later work (a residual prefetched before the weight walk, a head
vector's elements) is only in flight while nothing reads its register. When a conversion or a
store follows it inside the same basic block (a bf16 -> f32 shift, a store that may alias the
next load), the warp waits there for the L2 round trip, and N such loads in a row make N round
trips: the defect behind ~0.6 us of every o_proj / down phase and ~1.4 us of attention's input
on qwen3-0.6b (docs/perf-log.md, thirteenth session). This lists every global load (weights'
read-only loads excepted) whose destination register is read before the block ends, grouped by
the source line of the use, from the build's line info:

  python scripts/load_chains.py --model qwen3-0.6b --batch 1        # builds the plan (nvcc)
  python scripts/load_chains.py --sass megakernel.sass              # nvdisasm --print-line-info

Loads in a kind's prologue (before its waits) or in once-per-step kinds cost little; the ones
after a task's wait, on every layer, are the ones to fix. cuobjdump and nvdisasm come from the
CUDA toolkit or the pip wheels nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm (--tools DIR).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_INSTR = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_ENDS_BLOCK = ("BSYNC", "BRA", "EXIT", "BAR", "RET", "WARPSYNC", "CALL")
_WINDOW = 30  # instructions looked at after a load


@dataclass(frozen=True)
class Instr:
    addr: int
    op: str  # opcode with modifiers, predicate stripped
    args: str
    src: str  # "kind/file.cuh:line" of the innermost source line, or ""


@dataclass(frozen=True)
class Chain:
    load: Instr
    use: Instr
    distance: int  # instructions from the load to its first use


def _short(path: str, line: str) -> str:
    parts = Path(path).parts
    return f"{'/'.join(parts[-2:])}:{line}"


def parse(text: str) -> list[Instr]:
    """The instructions of an `nvdisasm --print-line-info` (or cuobjdump -sass) listing."""
    out, src = [], ""
    for raw in text.splitlines():
        m = _LINE.search(raw)
        if m:
            src = _short(m.group(1), m.group(2))
            continue
        m = _INSTR.match(raw)
        if not m:
            continue
        body = m.group(2).strip()
        if body.startswith("@"):
            body = body.split(None, 1)[1] if " " in body else ""
        op, _, args = body.partition(" ")
        out.append(Instr(int(m.group(1), 16), op, args.strip(), src))
    return out


def _reads(instr: Instr, reg: str) -> bool:
    operands = instr.args.split(",")
    if not instr.op.startswith(("ST", "RED", "ATOM")):
        operands = operands[1:]  # the first operand is written
    pattern = re.compile(rf"\b{re.escape(reg)}\b")
    return any(pattern.search(o) for o in operands)


def chains(instrs: list[Instr]) -> list[Chain]:
    """Every non-constant global load whose destination is read before the block ends."""
    found = []
    for i, ins in enumerate(instrs):
        if not ins.op.startswith("LDG") or "CONSTANT" in ins.op or ins.op == "LDGDEPBAR":
            continue
        dst = ins.args.split(",")[0].strip()
        for j in range(i + 1, min(i + 1 + _WINDOW, len(instrs))):
            nxt = instrs[j]
            if nxt.op.startswith(_ENDS_BLOCK):
                break
            if _reads(nxt, dst):
                found.append(Chain(ins, nxt, j - i))
                break
    return found


def report(found: list[Chain]) -> str:
    by_use = Counter(c.use.src or "?" for c in found)
    lines = [f"{len(found)} global loads read before their block ends, by the line that reads:"]
    lines += [f"  {n:4d}  {src}" for src, n in by_use.most_common()]
    return "\n".join(lines)


def _tool(name: str, tools: Path | None) -> str:
    if tools is not None and (tools / name).exists():
        return str(tools / name)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: put the CUDA toolkit's bin on PATH or pass --tools")
    return found


def listing_of_plan(model: str, batch: int, tools: Path | None) -> str:
    from mpk.backends.cuda import build
    from mpk.compiler.lower import compile_graph
    from mpk.models.builder import DecodeShape, build_graph
    from mpk.models.config import get_preset

    graph = build_graph(get_preset(model), DecodeShape(batch=batch, max_pages=16,
                                                       num_pages=16 * batch))
    plan = compile_graph(graph)
    with tempfile.TemporaryDirectory() as tmp:
        result = build.build_plan(plan, arch="sm_90a", cache_root=Path(tmp) / "cache")
        subprocess.run([_tool("cuobjdump", tools), "-xelf", "all", str(result.so_path)],
                       cwd=tmp, check=True, capture_output=True)
        cubin = next(Path(tmp).glob("*.cubin"))
        return subprocess.run([_tool("nvdisasm", tools), "--print-line-info", "-c", str(cubin)],
                              check=True, capture_output=True, text=True).stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--sass", type=Path, help="a listing to read instead of building the plan")
    p.add_argument("--tools", type=Path, help="folder holding cuobjdump and nvdisasm")
    args = p.parse_args()
    text = (args.sass.read_text() if args.sass is not None
            else listing_of_plan(args.model, args.batch, args.tools))
    print(report(chains(parse(text))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
