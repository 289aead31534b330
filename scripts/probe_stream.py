#!/usr/bin/env python
"""Probe runtime v2's weight-page pipeline alone, on the GPU: one call, one table.

One linear op spread over every SM, run for --steps steps in one launch. Its tasks wait on
nothing (x is an input and each task rewrites its own rows), so every SM streams its weight
slice back to back with no phase hand-offs: the time per step is the pipeline's own rate.
Configurations (a row each):
  pages      the page ring (codegen.MAX_PAGES): 4, 6, as many as fit (11 of 16 KB)
  page size  16 KB and 32 KB pages (tasks.base.PAGE_BYTES, patched in every module that copies it)
  bytes      weights beyond the 50 MB L2 (HBM-bound) and L2-resident (the loader or the
             consumers bound, not HBM)
  tasks/SM   1 and 8 tasks per SM for the same bytes: the fixed cost of a task
  batch      1 and 16 rows (the consumers' MMA work per weight byte)
Patching constants is what makes this a probe rather than a product path: the lever that wins
becomes the default in the code, and the numbers go to docs/perf-log.md.

  python scripts/probe_stream.py              # on the GPU: the table (and --json)
  python scripts/probe_stream.py --dry-run    # anywhere: compile every configuration's plan
                                              # and render its kernel source (no GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mpk.backends.cuda import codegen
from mpk.compiler import lower
from mpk.compiler.lower import compile_graph
from mpk.compiler.plan import Plan
from mpk.dtypes import DType
from mpk.graph.graph import DEFAULT_NUM_SMS, Graph
from mpk.tasks import base
from mpk.tasks.linear import geometry
from mpk.tensors import Role

K = 4096
HBM_ROWS_PER_SM = 64  # 64 x 4096 x 2 B = 512 KB per SM per step, 69 MB in all (> 50 MB L2)
L2_ROWS_PER_SM = 16  # 128 KB per SM, 17 MB in all: stays in L2 between steps


@dataclass(frozen=True)
class Config:
    name: str
    page_bytes: int = 16 * 1024
    max_pages: int = 12
    rows_per_sm: int = HBM_ROWS_PER_SM
    tasks_per_sm: int = 1
    batch: int = 1


CONFIGS = (
    Config("default (16 KB pages, as many as fit; HBM)"),
    Config("4 pages", max_pages=4),
    Config("6 pages", max_pages=6),
    Config("32 KB pages", page_bytes=32 * 1024, max_pages=6),
    Config("L2-resident", rows_per_sm=L2_ROWS_PER_SM),
    Config("L2-resident, 32 KB pages", rows_per_sm=L2_ROWS_PER_SM, page_bytes=32 * 1024,
           max_pages=6),
    Config("8 tasks per SM", tasks_per_sm=8),
    Config("batch 16", batch=16),
)


@contextmanager
def page_config(page_bytes: int, max_pages: int) -> Iterator[None]:
    """PAGE_BYTES and MAX_PAGES as the probe wants them, in every module holding a copy."""
    holders = [(base, "PAGE_BYTES"), (geometry, "PAGE_BYTES"),
               (codegen, "PAGE_BYTES"), (lower, "PAGE_BYTES")]
    saved = [(m, n, getattr(m, n)) for m, n in holders]
    saved += [(geometry, "PAGE_UNITS", geometry.PAGE_UNITS), (codegen, "MAX_PAGES",
                                                               codegen.MAX_PAGES)]
    try:
        for m, n in holders:
            setattr(m, n, page_bytes)
        geometry.PAGE_UNITS = page_bytes // geometry.UNIT_BYTES
        codegen.MAX_PAGES = max_pages
        yield
    finally:
        for m, n, v in saved:
            setattr(m, n, v)


def probe_plan(cfg: Config, num_sms: int) -> Plan:
    rows = cfg.rows_per_sm * num_sms
    g = Graph()
    g.add_tensor("x", (cfg.batch, K), DType.BF16, Role.IO)
    g.add_tensor("w", (rows, K), DType.BF16, Role.WEIGHT)
    g.add_tensor("y", (cfg.batch, rows), DType.BF16, Role.ACTIVATION)
    g.add_op("linear", "probe", (num_sms * cfg.tasks_per_sm,),
             {"x": "x", "weight": "w", "out": "y"})
    return compile_graph(g, num_sms, fuse_ops=False)


def measure(cfg: Config, steps: int, repeats: int) -> dict[str, float | str | int]:
    from mpk.backends.cuda.executor import CudaExecutor

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    with page_config(cfg.page_bytes, cfg.max_pages):
        plan = probe_plan(cfg, num_sms)
        ex = CudaExecutor(plan)
        gen = torch.Generator().manual_seed(0)
        rows = cfg.rows_per_sm * num_sms
        x = torch.randn(cfg.batch, K, generator=gen).bfloat16().cuda()
        w = (torch.randn(rows, K, generator=gen) / K ** 0.5).bfloat16().cuda()
        ex.bind("x", x)
        ex.bind("w", w)
        ex.run(steps)  # warm-up: the nvcc build, the weight stream, clocks
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            ex.run(steps)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / steps)
        want = (x.float() @ w.float().T).bfloat16().float()
        err = float((ex.read("y").float() - want.cpu()).abs().max())
        pages = codegen.num_pages(plan.scratch_bytes)
    ms = statistics.median(times)
    nbytes = rows * K * 2
    return {"config": cfg.name, "pages": pages, "page_kb": cfg.page_bytes // 1024,
            "mb_per_step": round(nbytes / 1e6, 2), "us_per_step": round(ms * 1e3, 2),
            "gb_s": round(nbytes / ms / 1e6, 1),
            "gb_s_per_sm": round(nbytes / ms / 1e6 / num_sms, 2), "max_abs_err": err}


def dry_run() -> None:
    """Every configuration's plan and kernel source, without a GPU (catches a broken patch)."""
    for cfg in CONFIGS:
        with page_config(cfg.page_bytes, cfg.max_pages):
            plan = probe_plan(cfg, DEFAULT_NUM_SMS)
            source = codegen.render(plan)
            assert f"PAGE_BYTES = {cfg.page_bytes};" in source
            print(f"{cfg.name}: {plan.num_tasks} tasks, {codegen.num_pages(plan.scratch_bytes)} "
                  f"pages, source {len(source)} chars")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.dry_run:
        dry_run()
        return 0
    rows = [measure(cfg, args.steps, args.repeats) for cfg in CONFIGS]
    if args.json:
        print(json.dumps({"k": K, "steps": args.steps, "rows": rows}))
    else:
        for row in rows:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
