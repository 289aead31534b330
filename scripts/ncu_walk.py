#!/usr/bin/env python
"""One profiled launch of a model's megakernel for Nsight Compute (run it under `ncu`).

Builds the model as `mpk bench` does (mpk.bench.mpk_decoder: random weights, the bench prompt),
runs one warm-up launch, then `--steps` decode steps in one launch between cudaProfilerStart and
cudaProfilerStop, so `ncu --profile-from-start off` measures exactly that launch:

  ncu --clock-control none --profile-from-start off --section WarpStateStats \
      --section SourceCounters -o walk python3 scripts/ncu_walk.py --model qwen3-0.6b
  ncu -i walk.ncu-rep --page source --csv --print-source sass > walk_sass.csv
  python3 scripts/ncu_walk.py --summarize walk_sass.csv     # stall samples per source line

The summary (CPU only) sums the warp-state samples of the SASS rows per innermost source line
and per stall reason, so the lines where warps wait show with the reason they wait.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter, defaultdict


def profile_launch(model: str, steps: int, batch: int) -> None:
    import torch

    from mpk.bench.mpk_decoder import MpkDecoder
    from mpk.bench.runner import bench_prompt
    from mpk.models.config import get_preset
    from mpk.models.weights import random_weights

    cfg = get_preset(model)
    weights = random_weights(cfg, 0, "cuda")
    dec = MpkDecoder(cfg, weights, bench_prompt(cfg, batch, 8, 0).cuda(), steps)
    dec.step(steps)  # warm-up: module load, first touch of the weights
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    dec.step(steps)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one launch of {steps} steps of {model} at batch {batch}")


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summarize(path: str, top: int) -> None:
    """Stall samples of the SASS rows of `ncu --page source --csv --print-source sass`, per
    column whose name says 'Sampl' (warp-state sampling), grouped by the row's source column."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head_i = next(i for i, r in enumerate(rows) if any("Source" in c for c in r))
    head = rows[head_i]
    src_col = next(i for i, c in enumerate(head) if c.strip() == "Source")
    samp_cols = [i for i, c in enumerate(head) if "Sampl" in c]
    print("sample columns:", [head[i] for i in samp_cols])
    total = Counter()
    by_instr: dict[str, float] = defaultdict(float)
    for r in rows[head_i + 1:]:
        if len(r) <= max(samp_cols + [src_col]):
            continue
        for i in samp_cols:
            total[head[i]] += _num(r[i])
        by_instr[r[src_col].strip()] += _num(r[samp_cols[0]])
    print("totals:", dict(total))
    opcode = Counter()
    for k, v in by_instr.items():
        opcode[k.split()[0] if k else "?"] += v
    print("samples by opcode:", opcode.most_common(top))
    print("hottest instructions:")
    for k, v in sorted(by_instr.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{v:10.0f}  {k}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--summarize", metavar="CSV", help="summarize an exported source page")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    if args.summarize:
        summarize(args.summarize, args.top)
    else:
        profile_launch(args.model, args.steps, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
