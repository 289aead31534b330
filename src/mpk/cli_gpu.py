"""The GPU-only commands of the CLI, `mpk bench` and `mpk profile` (argument parsing and
errors are cli.py's)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def _model_on_gpu(args: argparse.Namespace, command: str) -> tuple[Any, dict[str, Any], str]:
    """(config, weights on the GPU, model name) for --model or --checkpoint; GPU commands only."""
    import torch

    from mpk.errors import UnsupportedError

    if not torch.cuda.is_available():
        raise UnsupportedError(f"mpk {command} needs a CUDA GPU (torch.cuda is unavailable here)")
    if args.checkpoint:
        from mpk.models.weights import load_checkpoint

        cfg, weights = load_checkpoint(args.checkpoint)
        return cfg, {k: v.cuda() for k, v in weights.items()}, cfg.name or args.checkpoint
    from mpk.models.config import get_preset
    from mpk.models.weights import random_weights

    cfg = get_preset(args.model)
    return cfg, random_weights(cfg, args.seed, "cuda"), args.model


def bench(args: argparse.Namespace) -> int:
    import torch

    from mpk.bench.job import BenchJob, run_bench_job
    from mpk.bench.runner import format_table
    from mpk.engine.job import ModelSource
    from mpk.errors import UnsupportedError
    from mpk.models import get_preset, load_config

    if not torch.cuda.is_available():
        raise UnsupportedError("mpk bench needs a CUDA GPU (torch.cuda is unavailable here)")
    cfg = load_config(args.checkpoint) if args.checkpoint else get_preset(args.model)
    job = BenchJob(ModelSource(cfg, args.checkpoint, args.seed), args.batch, args.new_tokens)
    result = run_bench_job(job, args.tp)
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print(format_table(result))
        print(f"MPK compile: plan {result['mpk_plan_s']:.1f} s, nvcc {result['mpk_build_s']:.1f} "
              f"s (cached after the first run); first 16 greedy tokens agree: "
              f"{result['tokens_agree']}" + (f"; MPK on {args.tp} GPUs (tensor parallel), "
                                             f"torch.compile on 1" if args.tp > 1 else ""))
    return 0


def profile(args: argparse.Namespace) -> int:
    from mpk.profile.run import profile_model, summary_lines
    from mpk.profile.table import render_table

    cfg, weights, model = _model_on_gpu(args, "profile")
    out = args.out or f"mpk-profile/{str(model).strip('/').replace('/', '_')}"
    result = profile_model(cfg, args.steps, weights=weights, batch=args.batch, seed=args.seed,
                           out_dir=out)
    if args.json:
        print(json.dumps(result.summary, default=str))
        return 0
    from rich.console import Console

    Console(highlight=False).print(render_table(result.table))
    for line in summary_lines(result):
        print(line)
    return 0
