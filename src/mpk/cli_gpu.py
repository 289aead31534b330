"""The GPU-only commands of the CLI, `mpk bench` and `mpk profile` (argument parsing and
errors are cli.py's)."""

from __future__ import annotations

import argparse
import json

from mpk.engine.job import ModelSource


def _source(args: argparse.Namespace) -> ModelSource:
    """The model of --model or --checkpoint (weights not loaded yet): a preset with real
    weights (smollm2-135m) runs them, as in `mpk generate`, so its tokens mean something."""
    from mpk.models.resolve import resolve_model

    resolved = resolve_model(None if args.checkpoint else args.model, args.checkpoint,
                             progress=False if args.json else None)
    return ModelSource(resolved.cfg, resolved.checkpoint, args.seed)


def _gpu_source(args: argparse.Namespace, command: str) -> ModelSource:
    """_source, for the commands that need a GPU."""
    import torch

    from mpk.errors import UnsupportedError

    if not torch.cuda.is_available():
        raise UnsupportedError(f"mpk {command} needs a CUDA GPU (torch.cuda is unavailable here)")
    return _source(args)


def bench(args: argparse.Namespace, backend: str | None = None) -> int:
    from mpk.bench.job import BenchJob, run_bench_job
    from mpk.bench.runner import format_table

    if args.serving:
        return _bench_serving(args, backend or "cuda")
    if args.prefill is not None:
        return _bench_prefill(args)
    job = BenchJob(_gpu_source(args, "bench"), args.batch, args.new_tokens)
    result = {**run_bench_job(job, args.tp), "random_weights": job.source.checkpoint is None}
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print(format_table(result))
        print(f"MPK compile: plan {result['mpk_plan_s']:.1f} s, nvcc {result['mpk_build_s']:.1f} "
              f"s (cached after the first run); first 16 greedy tokens agree: "
              f"{result['tokens_agree']}" + (f"; MPK on {args.tp} GPUs (tensor parallel), "
                                             f"torch.compile on 1" if args.tp > 1 else ""))
    return 0


def _bench_serving(args: argparse.Namespace, backend: str) -> int:
    from mpk.backends.registry import get_backend
    from mpk.bench.serving import format_report, make_trace, positions_needed, run_serving_bench
    from mpk.engine.engine import Engine
    if args.tp > 1:
        from mpk.errors import UnsupportedError

        raise UnsupportedError("mpk bench --serving runs on one GPU (--tp 1)")
    source = _source(args)
    cfg = source.cfg
    trace = make_trace(cfg.vocab_size, args.requests, args.prompt_len, args.output_len,
                       args.rate, args.seed)
    steps = args.steps_per_launch
    engine = Engine(cfg, source.load(get_backend(backend).device_type), backend=backend,
                    max_seq_len=positions_needed(trace, steps), steps_per_launch=steps,
                    prefill_chunk=args.prefill_chunk, progress=False if args.json else None)
    result = {"model": args.checkpoint or args.model, "backend": backend,
              "random_weights": source.checkpoint is None,
              **run_serving_bench(engine, trace, args.max_batch)}
    if args.json:
        print(json.dumps(result))
    else:
        for line in format_report(result):
            print(line)
    return 0 if result["outputs_equal_solo"] else 1


def _bench_prefill(args: argparse.Namespace) -> int:
    from mpk.bench.baseline import StaticDecoder
    from mpk.bench.prefill import format_prefill, random_prompt, run_prefill_bench
    from mpk.engine.engine import Engine

    source = _gpu_source(args, "bench")
    cfg = source.cfg
    weights = source.load("cuda")
    prompt = random_prompt(cfg.vocab_size, args.prefill, args.seed)
    max_seq = args.prefill + 16
    # The prompt runs through the prefill plan (--prefill-chunk positions a launch), or with
    # --prefill-chunk 0 on exactly --max-batch rows (no wider plan).
    engine = Engine(cfg, weights, backend="cuda", max_seq_len=max_seq,
                    prefill_rows=args.max_batch, prefill_chunk=args.prefill_chunk,
                    progress=False if args.json else None)
    model = StaticDecoder(cfg, weights, max_seq)
    result = {"model": args.checkpoint or args.model, "random_weights": source.checkpoint is None,
              **run_prefill_bench(engine, model, prompt, args.max_batch)}
    if args.json:
        print(json.dumps(result))
    else:
        for line in format_prefill(result):
            print(line)
    return 0


def profile(args: argparse.Namespace) -> int:
    from mpk.profile.phases import render_phases
    from mpk.profile.run import profile_model, summary_lines
    from mpk.profile.table import render_table

    source = _gpu_source(args, "profile")
    cfg, weights = source.cfg, source.load("cuda")
    model = (cfg.name or args.checkpoint) if args.checkpoint else args.model
    out = args.out or f"mpk-profile/{str(model).strip('/').replace('/', '_')}"
    result = profile_model(cfg, args.steps, weights=weights, batch=args.batch, seed=args.seed,
                           out_dir=out)
    if args.json:
        print(json.dumps(result.summary, default=str))
        return 0
    from rich.console import Console

    Console(highlight=False).print(render_table(result.table))
    Console(highlight=False).print(render_phases(result.phases, result.timeline.num_steps))
    for line in summary_lines(result):
        print(line)
    return 0
