#!/usr/bin/env python
"""How the tasks of one op spread out, on the GPU: is an op's phase set by a late start or by a
long body on its critical (last-ending) task?

mpk profile's phase table follows each op's critical task only (mpk/profile/phases.py). Here,
per op role (mean over layers and steps, us): the spread of the tasks' RUN times after the
previous op's last END (min / mean / max), their body parts (input RUN->INPUT, compute
INPUT->COMPUTE, epilogue COMPUTE->DONE, signal DONE->END: mean / p90 / max over the op's tasks),
and how much later the critical task ended than the mean task.

  python scripts/phase_spread.py --model qwen3-0.6b [--batch 1] [--steps 30] [--run walk_start]
(on the GPU; --run: one of scripts/probe_model.py's patched builds; walk_start splits compute at
warp 0's entry into the last block's walk).
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np

from mpk.models.config import get_preset
from mpk.profile.phases import role_of


def spread(tl) -> dict[str, dict[str, float]]:  # type: ignore[no-untyped-def]
    nops = len(tl.plan.ops)
    key = tl.step * nops + tl.op
    parts = {"input": tl.input_ns - tl.ready_ns, "compute": tl.compute_ns - tl.input_ns,
             "to_walk": tl.start_ns - tl.input_ns, "walk": tl.compute_ns - tl.start_ns,
             "epilogue": tl.done_ns - tl.compute_ns, "signal": tl.end_ns - tl.done_ns}
    rows: dict[str, list[dict[str, float]]] = {}
    order = np.argsort(key, kind="stable")
    keys, first = np.unique(key[order], return_index=True)
    groups = np.split(order, first[1:])
    last_end = {int(k): int(tl.end_ns[g].max()) for k, g in zip(keys, groups)}
    for k, m in zip(keys, groups):
        _, op = divmod(int(k), nops)
        if op == 0 or int(k) - 1 not in last_end:
            continue
        prev = last_end[int(k) - 1]
        run = (tl.ready_ns[m] - prev) / 1e3
        end = (tl.end_ns[m] - prev) / 1e3
        r = {"tasks": float(len(m)), "run_min": run.min(), "run_mean": run.mean(),
             "run_max": run.max(), "end_mean": end.mean(), "end_max": end.max()}
        for name, v in parts.items():
            x = v[m] / 1e3
            r[f"{name}_mean"], r[f"{name}_p90"], r[f"{name}_max"] = (
                x.mean(), np.percentile(x, 90), x.max())
        rows.setdefault(role_of(tl.plan.ops[op].name), []).append(r)
    return {role: {f: float(np.mean([r[f] for r in rs])) for f in rs[0]} for role, rs in rows.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--run", default="none", help="a scripts/probe_model.py run (patched build)")
    args = p.parse_args()
    from probe_model import RUNS
    from probe_phases import include_dir, probe_build

    from mpk.profile.run import profile_model

    with (include_dir(RUNS[args.run]) as inc, probe_build(RUNS[args.run]),
          tempfile.TemporaryDirectory() as out):
        res = profile_model(get_preset(args.model), steps=args.steps, batch=args.batch,
                            out_dir=out, repeats=3, measure_bandwidth=False, extra_includes=(inc,))
    print(f"{args.model} b{args.batch}: {res.timing['profiled_ms_per_token']:.3f} ms/token (profiled)")
    for role, r in spread(res.timeline).items():
        print(f"{role:24s} tasks {r['tasks']:.0f}  RUN after prev END min/mean/max "
              f"{r['run_min']:.2f}/{r['run_mean']:.2f}/{r['run_max']:.2f}  END mean/max "
              f"{r['end_mean']:.2f}/{r['end_max']:.2f}")
        print("    " + "  ".join(f"{n} {r[n + '_mean']:.2f}/{r[n + '_p90']:.2f}/{r[n + '_max']:.2f}"
                                 for n in ("input", "compute", "epilogue", "signal")))
        if args.run == "walk_start":  # WAIT := warp 0's entry into the last block's walk
            print("    " + "  ".join(f"{n} {r[n + '_mean']:.2f}/{r[n + '_p90']:.2f}/{r[n + '_max']:.2f}"
                                     for n in ("to_walk", "walk")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
