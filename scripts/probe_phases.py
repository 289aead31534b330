#!/usr/bin/env python
"""Where a linear task's time goes, on the GPU: phase stamps, runtime counters, ablations.

probe_stream.py times one linear op over every SM; this probe takes that op apart. Each run
builds the op's megakernel from patched copies of tasks/linear/sm90.cuh and the runtime headers
(an include directory searched before the real ones; nothing in the product changes):
  staged, page0, mma, done   the record's WAIT stamp := warp 0's time at that point of the task
                             (x staged; first weight page landed; MMA walk and epilogue issued;
                             every page released), reported as the mean of (stamp - RUN)
  pagewait                   WAIT := warp 0's total time waiting for pages to land, per task
  loader                     two extra stamps: the loader's time blocked on free pages and on the
                             fetcher, per record
  evict_normal, split_4k/1k  levers: the weights' L2 policy; 16 KB pages as 4 KB / 1 KB copies
  no_mma, no_wload           ablations (wrong results, timing only): no MMAs and x loads; no
                             weight loads
  no_pagewait, test_wait     pages used without waiting (timing only); a non-blocking first test
Every run reports the step time (CUDA events, median of 3); profiled ones also END - RUN, the
consumers' wait for the ready mark and the RUN-to-RUN period. Means, not medians: %globaltimer
ticks are coarse, means over thousands of records are not. Results: docs/perf-log.md.

  python scripts/probe_phases.py [--runs none,loader] [--json]   # on the GPU
  python scripts/probe_phases.py --dry-run    # anywhere: every patch applies, sources render
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from probe_stream import CONFIGS, Config, page_config, probe_plan

from mpk.backends.cuda import codegen
from mpk.graph.graph import DEFAULT_NUM_SMS
from mpk.tasks.registry import TASKS_DIR

CSRC = codegen.CSRC_DIR
SOURCES = {"linear/sm90.cuh": TASKS_DIR / "linear" / "sm90.cuh",
           "linear/sm90_walk.cuh": TASKS_DIR / "linear" / "sm90_walk.cuh",
           "attention/sm90.cuh": TASKS_DIR / "attention" / "sm90.cuh",
           "moe_gate_up/sm90.cuh": TASKS_DIR / "moe_gate_up" / "sm90.cuh",
           "moe_down/sm90.cuh": TASKS_DIR / "moe_down" / "sm90.cuh",
           "moe_router/sm90.cuh": TASKS_DIR / "moe_router" / "sm90.cuh",
           "runtime.cuh": CSRC / "runtime.cuh", "task_args.cuh": CSRC / "task_args.cuh",
           "ptx.cuh": CSRC / "ptx.cuh"}
# The Slot's t_wait field (runtime.cuh): rec, params, base[], stream, then t_wait.
T_WAIT_OFFSET = "(4 * (REC_WORDS + PARAM_WORDS) + 8 * (REC_MAX_OPERANDS + 1))"


def stamp(value: str = "mpk::ptx::globaltimer()") -> str:
    return ("if (threadIdx.x == 0) *reinterpret_cast<volatile unsigned long long*>("
            "reinterpret_cast<char*>(const_cast<int*>(a.rec)) + " + T_WAIT_OFFSET +
            f") = {value};")


STAMP = stamp()
STAGE = "    stage_chunk(t, s, ch);\n"
CHUNK_END = "    if (ch + 1 < t.nch) mpk::task_sync();\n"
FINISH = "  pc.finish();\n  if (t.argmax)"
# The walk's units at batch <= 8 (mma_units, narrow): A reads, MMAs; and a page's weight reads.
UNIT_X = "      if (kWhole || j < n) a[j] = dev::lds_v4(x + j * xstep);\n"
UNIT_MMA = "      if (kWhole || j < n) mma_unit(c.lo[j & 1], f.w[j], a[j]);\n"
UNIT_W = "    if (kWhole || j < n) f.w[j] = dev::lds_v4(wu + j * kWarps * kUnitBytes);\n"
FIRST_WAIT = "    if (!ptx::mbar_try_wait(bar, parity)) {\n"
PAGE_WAIT = """    if (!ptx::mbar_try_wait(bar, parity)) {
      const unsigned long long t0 = ptx::globaltimer();
      while (!ptx::mbar_try_wait(bar, parity))
        if (ptx::globaltimer() - t0 > (unsigned long long)limit_ns) __trap();
    }
"""
LOADED_WAIT = ("    if (!wait_unless_gone(ptx::smem_u32(&sh.bars.loaded[sl]), round & 1u, "
               "&sh.consumers_gone))\n      return drain(sh, seq, p.timeout_ns);\n")
EMPTY_WAIT = "        if (!wait_unless_gone(ptx::smem_u32(&sh.bars.empty[ps])"
EMPTY_RET = "                              &sh.consumers_gone))\n          return drain(sh, seq, p.timeout_ns);\n"
FREED = "    ptx::mbar_arrive(ptx::smem_u32(&sh.bars.freed[sl]));  // done reading the slot\n"
COPY = "        ptx::bulk_copy_g2s(ring + ps * (uint32_t)PAGE_BYTES, src, sizes[r], full, policy);\n"
RECORD_END = "        src += sizes[r];\n      }\n    }\n"
LOADER_ROW = """#ifdef MPK_PROFILE
    if (p.profile != nullptr) {
      unsigned long long* row = p.profile + (((long long)pstep * gridDim.x + blockIdx.x) *
                                             p.max_len + pindex) * PROF_STAMPS;
      row[3] = t_empty;
      row[4] = t_loaded;
    }
#endif
"""


def split_copy(piece: int) -> str:
    return (f"        for (uint32_t o = 0; o < sizes[r]; o += {piece}u)\n"
            "          ptx::bulk_copy_g2s(ring + ps * (uint32_t)PAGE_BYTES + o, src + o,\n"
            f"                             min({piece}u, sizes[r] - o), full, policy);\n")


Patch = dict[str, list[tuple[str, str]]]  # file (relative to the include root) -> edits
PATCHES: dict[str, Patch] = {
    "none": {},
    "staged": {"linear/sm90.cuh": [(STAGE, STAGE + f"    if (ch == 0) {{ {STAMP} }}\n")]},
    "page0": {"linear/sm90.cuh": [(STAGE, STAGE + f"    if (ch == 0) {{ pc.at(0); {STAMP} }}\n")]},
    "mma": {"linear/sm90.cuh": [(CHUNK_END, f"    {STAMP}\n" + CHUNK_END)]},
    "done": {"linear/sm90.cuh": [(FINISH, f"  pc.finish();\n  {STAMP}\n  if (t.argmax)")]},
    # WAIT := warp 0's total time in PageCursor::at waiting for pages to land, in this task.
    "pagewait": {
        "task_args.cuh": [("  long long limit_ns;",
                           "  long long limit_ns;\n  mutable unsigned long long waited = 0;"),
                          (PAGE_WAIT, "    const unsigned long long tw = ptx::globaltimer();\n"
                           + PAGE_WAIT + "    waited += ptx::globaltimer() - tw;\n")],
        "linear/sm90.cuh": [(FINISH, f"  pc.finish();\n  {stamp('pc.waited')}\n  if (t.argmax)")]},
    # Stamps 3 and 4 := the loader's time blocked on free pages / on the fetcher, per record.
    "loader": {"runtime.cuh": [
        (LOADED_WAIT, "    const unsigned long long tl0 = ptx::globaltimer();\n" + LOADED_WAIT
         + "    const unsigned long long t_loaded = ptx::globaltimer() - tl0;\n"
           "    unsigned long long t_empty = 0;\n"),
        (FREED, "    const int pstep = sh.slot[sl].step, pindex = sh.slot[sl].index;\n" + FREED),
        (EMPTY_WAIT, "        const unsigned long long te0 = ptx::globaltimer();\n" + EMPTY_WAIT),
        (EMPTY_RET, EMPTY_RET + "        t_empty += ptx::globaltimer() - te0;\n"),
        (RECORD_END, RECORD_END + LOADER_ROW)]},
    # Levers, timing only.
    "evict_normal": {"ptx.cuh": [("L2::evict_first.b64 %0, 1.0", "L2::evict_normal.b64 %0, 1.0")]},
    "split_4k": {"runtime.cuh": [(COPY, split_copy(4096))]},
    "split_1k": {"runtime.cuh": [(COPY, split_copy(1024))]},
    # Ablations (wrong results, timing only).
    # (batch <= 8: the narrow walk)
    "no_mma": {"linear/sm90_walk.cuh": [  # neither the MMAs nor the x loads; weights still read
        (UNIT_X, "      ;\n"),
        (UNIT_MMA, "      if (kWhole || j < n) c.lo[j & 1].p[0] += "
                   "__uint_as_float(f.w[j].x ^ f.w[j].y ^ f.w[j].z ^ f.w[j].w);\n")]},
    "no_wload": {"linear/sm90_walk.cuh": [  # no weight loads; MMAs on a made-up fragment
        (UNIT_W, "    if (kWhole || j < n) f.w[j] = make_uint4(u + j, pg, (u + j) ^ 7, pg ^ 5);\n")]},
    "no_pagewait": {"task_args.cuh": [(FIRST_WAIT, "    if (false) {\n")]},
    "test_wait": {"task_args.cuh": [(FIRST_WAIT, FIRST_WAIT.replace("try_wait", "test_wait"))]},
}
PHASES = ("staged", "page0", "mma", "done", "pagewait")
RUNS = tuple(PATCHES)
PROBE_CONFIGS = (CONFIGS[0], CONFIGS[4], CONFIGS[6])  # HBM, L2-resident, 8 tasks/SM
EXTRA_STAMPS = {"LOADER_EMPTY": 3, "LOADER_LOADED": 4}


def patched(name: str, rel: str) -> str:
    text = SOURCES[rel].read_text()
    for old, new in PATCHES[name][rel]:
        if text.count(old) != 1:
            raise SystemExit(f"probe patch {name}: anchor {old.strip()!r} is not unique in {rel}")
        text = text.replace(old, new)
    return text


@contextmanager
def include_dir(name: str) -> Iterator[Path]:
    """An include directory (searched first) with the patched copies; common/ links to the real
    one, so the kinds' relative includes resolve."""
    with tempfile.TemporaryDirectory(prefix=f"mpk-probe-{name}-") as tmp:
        root = Path(tmp)
        # The csrc headers include each other by quotes (their own directory first): when one
        # is patched, all of them come along, or the originals would be pulled in beside it.
        if any(not rel.startswith("linear/") for rel in PATCHES[name]):
            for header in CSRC.glob("*.cuh"):
                (root / header.name).write_text(header.read_text())
        for rel in PATCHES[name]:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(patched(name, rel))
        (root / "common").symlink_to(TASKS_DIR / "common", target_is_directory=True)
        yield root


@contextmanager
def probe_build(name: str) -> Iterator[None]:
    """Renders with a static_assert that T_WAIT_OFFSET is Slot::t_wait's offset, and (loader)
    the two extra profile stamps."""
    original, stamps = codegen.render, dict(codegen.PROFILE_STAMPS)

    def render(plan, profile=False):  # type: ignore[no-untyped-def]
        return (original(plan, profile) + "\n#include <cstddef>\nstatic_assert(offsetof("
                f"mpk::Slot, t_wait) == {T_WAIT_OFFSET}, \"probe stamp offset\");\n")

    codegen.render = render
    if name == "loader":
        codegen.PROFILE_STAMPS.update(EXTRA_STAMPS)
    try:
        yield
    finally:
        codegen.render = original
        codegen.PROFILE_STAMPS.clear()
        codegen.PROFILE_STAMPS.update(stamps)


def run_patch(cfg: Config, name: str, steps: int) -> dict[str, float | str]:
    from mpk.backends.cuda.executor import CudaExecutor

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    with page_config(cfg.page_bytes, cfg.max_pages), include_dir(name) as inc, probe_build(name):
        plan = probe_plan(cfg, num_sms)
        profile = name in (*PHASES, "none", "loader")
        ex = CudaExecutor(plan, extra_includes=[inc], profile=profile)
        gen = torch.Generator().manual_seed(0)
        rows = cfg.rows_per_sm * num_sms
        ex.bind("x", torch.randn(cfg.batch, 4096, generator=gen).bfloat16().cuda())
        ex.bind("w", (torch.randn(rows, 4096, generator=gen) / 64).bfloat16().cuda())
        ex.run(steps)
        torch.cuda.synchronize()
        times = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            ex.run(steps)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / steps)
        row: dict[str, float | str] = {"config": cfg.name, "patch": name,
                                       "us_per_step": round(statistics.median(times), 2)}
        if profile:
            row.update(phase_means(ex.last_profile()[0], steps, name))
    return row


def phase_means(stamps: np.ndarray, steps: int, name: str) -> dict[str, float]:
    """Means in us over records of steps >= steps/4 (warm): phase - RUN (or RUN - WAIT for the
    unpatched build: the consumers' wait for the ready mark; the total for pagewait), END - RUN,
    the RUN-to-RUN period on an SM, and (loader) its blocked time per record."""
    s = stamps[steps // 4:].astype(np.float64)  # [steps, sms, len, stamps]
    wait, run, end = s[..., 0], s[..., 1], s[..., 2]
    ran = (run > 0) & (end > 0)
    out = {"end_minus_run_us": float(((end - run)[ran]).mean() / 1e3)}
    if name in ("none", "loader"):
        out["run_minus_wait_us"] = float(((run - wait)[ran]).mean() / 1e3)
    elif name == "pagewait":
        out["page_wait_us"] = float(wait[ran].mean() / 1e3)
    else:
        out[f"{name}_minus_run_us"] = float(((wait - run)[ran]).mean() / 1e3)
    if name == "loader":
        out["loader_blocked_on_free_pages_us"] = float(s[..., 3][ran].mean() / 1e3)
        out["loader_blocked_on_fetcher_us"] = float(s[..., 4][ran].mean() / 1e3)
    # Period: consecutive records of one SM, across the step boundary too.
    runs = np.moveaxis(run, 1, 0).reshape(run.shape[1], -1)  # [sms, steps*len]
    periods = [np.diff(r[r > 0]) for r in runs]
    out["period_us"] = float(np.concatenate(periods).mean() / 1e3)
    return {k: round(v, 3) for k, v in out.items()}


def dry_run() -> None:
    """Every patch applies and its kernel source renders (compile it with nvcc: --compile)."""
    for name in PATCHES:
        with include_dir(name) as inc, probe_build(name):
            plan = probe_plan(PROBE_CONFIGS[-1], DEFAULT_NUM_SMS)
            source = codegen.render(plan, True)
            assert "static_assert(offsetof(" in source
            print(f"{name}: {sorted(str(p.relative_to(inc)) for p in inc.rglob('*.cuh'))}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated patch names")
    args = p.parse_args()
    if args.dry_run:
        dry_run()
        return 0
    names = args.runs.split(",")
    if unknown := sorted(set(names) - set(PATCHES)):
        p.error(f"unknown runs {unknown}; choose from {', '.join(PATCHES)}")
    rows = []
    for cfg in PROBE_CONFIGS:
        for name in names:
            row = run_patch(cfg, name, args.steps)
            rows.append(row)
            print("  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
