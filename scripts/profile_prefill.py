"""Where a prefill-plan launch goes on the GPU: one chunk of C positions at p0 (the last chunk
of a P-token prompt by default, the one with the most cached context), profiled per kind and
per op with the runtime's timestamps (the profiling build of the same plan, same tensors).

  python3 scripts/profile_prefill.py --model qwen3-0.6b --prompt 2048 --chunk 256 [--json]

`--ncu`: instead of the timestamps, one more launch of the plain build between
cudaProfilerStart and cudaProfilerStop, for `ncu --profile-from-start off` (as scripts/ncu_walk.py
says: warp-state samples per SASS instruction; `--summarize` reads the exported source page).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from mpk.backends.cuda.executor import CudaExecutor
from mpk.engine.engine import _bind_all, _graph_weights
from mpk.engine.kv_cache import KvCache, KvShape
from mpk.models import decode_io as io
from mpk.models.config import get_preset
from mpk.models.prefill import PrefillShape, build_prefill_graph
from mpk.models.weights import random_weights
from mpk.profile.table import kind_table
from mpk.profile.timeline import from_stamps
from mpk.compiler.cache import compile_cached


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--start", type=int, default=None, help="p0 (default: prompt - chunk)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ncu", action="store_true", help="one profiled launch for Nsight Compute")
    args = ap.parse_args()
    cfg = get_preset(args.model)
    device = torch.device("cuda")
    page_size, pages = 16, -(-(args.prompt + 16) // 16)
    shape = PrefillShape(chunk=args.chunk, page_size=page_size, max_pages=pages, num_pages=pages)
    plan = compile_cached(build_prefill_graph(cfg, shape, 132), 132)
    weights = _graph_weights(cfg, random_weights(cfg, 0, device), pages * page_size, device,
                             None)
    cache = KvCache(KvShape(cfg.num_layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim),
                    device=device)
    plain, prof = CudaExecutor(plan, device), CudaExecutor(plan, device, profile=True)

    _bind_all(plan, plain, weights, cache, device)
    for t in plan.tensors:
        if t.role in ("weight", "io"):
            prof.bind(t.name, plain.tensor(t.name))
    p0 = args.prompt - args.chunk if args.start is None else args.start
    gen = torch.Generator().manual_seed(0)
    for ex in (plain, prof):
        ex.write(io.PROMPT, torch.randint(cfg.vocab_size, (1, args.chunk), generator=gen,
                                          dtype=torch.int32))
        ex.write(io.POSITIONS, torch.tensor([p0], dtype=torch.int32))
        ex.write(io.CHUNK, torch.tensor([args.chunk], dtype=torch.int32))
        ex.write(io.HEAD_POSITION, torch.tensor([p0 + args.chunk - 1], dtype=torch.int32))
        ex.write(io.PAGE_TABLE, torch.arange(pages, dtype=torch.int32)[None])
    times = []
    for i in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        plain.run(1)
        end.record()
        torch.cuda.synchronize()
        if i:
            times.append(start.elapsed_time(end))
    if args.ncu:
        torch.cuda.cudart().cudaProfilerStart()
        plain.run(1)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled one launch (median {statistics.median(times):.3f} ms unprofiled)")
        return
    prof.run(1)
    prof.run(1)
    stamps, step_begin = prof.last_profile()
    tl = from_stamps(stamps, plan, step_begin)
    table = kind_table(tl, None)
    result = {"model": args.model, "chunk": args.chunk, "p0": p0,
              "launch_ms": statistics.median(times), "stamps_ms": tl.ns_per_step / 1e6,
              "kinds": table.to_json()}
    if args.json:
        print(json.dumps(result, default=str))
        return
    print(f"{args.model} chunk {args.chunk} at p0 {p0}: launch {result['launch_ms']:.3f} ms "
          f"(median of 5), stamps span {result['stamps_ms']:.3f} ms")
    from rich.console import Console

    from mpk.profile.table import render_table

    Console(highlight=False, width=160).print(render_table(table))


if __name__ == "__main__":
    main()
