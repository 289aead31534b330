"""The commands of the `mpk` command line that run on any backend: generate, plan, check
(cli.py parses the arguments; cli_gpu.py has bench and profile; mpk.server has serve).

Imports nothing heavy at module level, so `mpk --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from mpk.errors import MpkError

if TYPE_CHECKING:
    from mpk.models.config import ModelConfig

DEFAULT_PROMPT_IDS = (1, 2, 3, 4)
DEFAULT_PROMPT_TEXT = "The capital of France is"
CHECK_ROWS_SHOWN = 40  # mpk check prints every row up to this many


# ---- shared helpers --------------------------------------------------------------------------
def _backend(args: argparse.Namespace) -> str:
    import torch

    from mpk.engine.engine import check_backend

    backend = args.backend or ("cuda" if torch.cuda.is_available() else "cpu")
    check_backend(backend)
    return backend


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def _note(message: str) -> None:
    print(f"mpk: {message}", file=sys.stderr)


def _table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(str(x) for x in row))
    return table


# ---- mpk generate ----------------------------------------------------------------------------
def _cmd_generate(args: argparse.Namespace) -> int:
    from mpk.engine.job import GenerateJob, ModelSource, run_job
    from mpk.engine.requests import SamplingParams
    from mpk.models.resolve import resolve_model

    # Bad sampling options fail before the model loads.
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed, stop=tuple(args.stop))
    backend = _backend(args)
    resolved = resolve_model(args.model if not args.checkpoint else None, args.checkpoint,
                             progress=False if args.json else None)
    cfg, model, tokenizer, checkpoint = (resolved.cfg, resolved.label, resolved.tokenizer,
                                         resolved.checkpoint)
    if checkpoint is None:
        _note(f"preset {model!r} runs with random weights (seed {args.weights_seed}); the "
              f"generated ids "
              f"carry no meaning (smollm2-135m runs real weights)")
    if (args.prompt or args.chat) and tokenizer is None:
        where = (f"{checkpoint} has no tokenizer.json or GGUF vocabulary" if checkpoint
                 else "random-weight presets have none")
        raise MpkError(f"--prompt needs a tokenizer ({where}); give token ids with --prompt-ids "
                       f"1,2,3 or a checkpoint that has one")
    if args.chat:
        if args.prompt_ids or resolved.chat_template is None:
            raise MpkError("--chat needs --prompt TEXT and a model with a chat template"
                           + ("" if args.prompt_ids else f" ({model} has none)"))
        chats = [resolved.chat_template.prompt(t) for t in args.prompt or [DEFAULT_PROMPT_TEXT]]
        # The template writes the special tokens itself: no BOS added on top.
        prompts = [tokenizer.encode(text, add_special_tokens=False).ids for text in chats]
    elif args.prompt:
        prompts = [tokenizer.encode(text).ids for text in args.prompt]
    elif args.prompt_ids:
        prompts = args.prompt_ids
    elif tokenizer is not None:
        prompts = [tokenizer.encode(DEFAULT_PROMPT_TEXT).ids]
    else:
        prompts = [list(DEFAULT_PROMPT_IDS)]
    # Default KV length: what this request needs (the engine rounds it up to whole pages).
    need = max(len(p) for p in prompts) + max(args.max_new_tokens, 1) - 1
    if args.stop and tokenizer is None:
        raise MpkError("--stop needs a tokenizer (the model has none): stop strings are text")
    job = GenerateJob(ModelSource(cfg, checkpoint, args.weights_seed), prompts,
                      args.max_new_tokens, () if args.ignore_eos else cfg.eos_token_ids, backend,
                      args.num_sms, args.max_seq_len or need, args.steps_per_launch,
                      prefill_rows=args.prefill_rows, prefill_chunk=args.prefill_chunk,
                      progress=False if args.json else None,
                      sampling=sampling, tokenizer=tokenizer if args.stop else None)
    result = run_job(job, args.tp)
    texts = result.texts
    if texts is None and tokenizer is not None:
        texts = [tokenizer.decode(ids) for ids in result.token_ids]
    if args.json:
        out = {"model": model, "backend": backend, "tp": args.tp,
               "random_weights": checkpoint is None,
               "weights_seed": None if checkpoint else args.weights_seed,
               "sampling": {"temperature": args.temperature, "top_k": args.top_k,
                            "top_p": args.top_p, "seed": args.seed, "stop": args.stop},
               "prompt_ids": prompts,
               "token_ids": result.token_ids,
               "timings": {k: round(float(v), 6) for k, v in result.timings.items()}}
        if texts is not None:
            out["text"] = texts
        print(json.dumps(out))
        return 0
    for i, (prompt, ids) in enumerate(zip(prompts, result.token_ids, strict=True)):
        print(f"prompt {i}: {prompt} -> {ids}")
        if texts is not None:
            print(f"  {tokenizer.decode(prompt)!r} -> {texts[i]!r}")
    t = result.timings
    print(f"{backend}: compile {t['compile_s']:.2f} s, load {t['load_s']:.2f} s, "
          f"{int(t['steps'])} steps in {int(t['launches'])} launches: prefill "
          f"{t['prefill_s'] * 1e3:.1f} ms, decode {t['decode_s'] * 1e3:.1f} ms "
          f"({t['ms_per_token']:.2f} ms/token)")
    return 0


# ---- mpk plan --------------------------------------------------------------------------------
def _cmd_plan(args: argparse.Namespace) -> int:
    from mpk.compiler.lower import compile_graph
    from mpk.engine import EngineConfig
    from mpk.models import get_preset, load_config
    from mpk.models.builder import build_graph

    cfg = load_config(args.checkpoint) if args.checkpoint else get_preset(args.model)
    options = EngineConfig(num_sms=args.num_sms, steps_per_launch=args.steps_per_launch,
                           max_seq_len=min(args.max_seq_len, cfg.max_position))
    shape = options.decode_shape(args.batch)
    start = time.perf_counter()
    quiet = args.json or not sys.stderr.isatty()
    tp = None
    if args.tp > 1:
        from mpk.parallel import TensorParallel

        tp = TensorParallel(0, args.tp)  # every rank's plan has the same tasks and schedule
    with nullcontext() if quiet else _console(stderr=True).status(f"compiling {cfg.name}"):
        graph = build_graph(cfg, shape, num_sms=args.num_sms, tp=tp)
        plan = compile_graph(graph, num_sms=args.num_sms)
    compile_s = time.perf_counter() - start
    meta = plan.meta
    summary = {"model": cfg.name, "tp": args.tp, "num_sms": plan.num_sms, "batch": args.batch,
               "steps_per_launch": args.steps_per_launch, "max_seq_len": options.max_seq_len,
               "num_ops": len(plan.ops), "num_tasks": plan.num_tasks,
               "num_counters": plan.num_counters, "arena_bytes": plan.arena_bytes,
               "compile_s": round(compile_s, 3), "digest": plan.digest()}
    if args.json:
        print(json.dumps({**summary, "meta": meta}, default=str))
        return 0
    console = _console()
    console.print(_table(f"plan of {cfg.name}", ("", "value"), list(summary.items())))
    tasks = meta.get("tasks_per_kind", {})
    ops = meta.get("ops_per_kind", {})
    console.print(_table("ops per kind", ("kind", "ops", "tasks"),
                         [(k, ops.get(k, 0), tasks.get(k, 0))
                          for k in sorted(set(ops) | set(tasks))]))
    waits = meta.get("waits_histogram", {})
    console.print(_table("waits per task", ("waits", "tasks"),
                         sorted(waits.items(), key=lambda kv: int(kv[0]))))
    busy = meta.get("sm_busy_us", {})
    if busy:
        spread = busy["max"] / busy["mean"] if busy["mean"] else float("nan")
        console.print(_table("predicted busy time per SM (us per step)",
                             ("min", "mean", "max", "max / mean"),
                             [(f"{busy['min']:.2f}", f"{busy['mean']:.2f}", f"{busy['max']:.2f}",
                               f"{spread:.2f}")]))
    rows = [("predicted time per token", f"{meta.get('predicted_us_per_step', float('nan'))} us")]
    if "floor_us_per_step" in meta:
        rows.append(("weight-read floor", f"{meta['floor_us_per_step']} us"))
        rows.append(("weight bytes per token", f"{meta.get('weight_bytes_per_step', 0):,}"))
    title = "prediction (batch step)"
    if tp is not None:  # the cost model prices the all-reduce's bytes, not NVLink's latency
        title += f", one rank of {args.tp}; cross-GPU latency not modelled"
    console.print(_table(title, ("", "value"), rows))
    return 0


# ---- mpk check -------------------------------------------------------------------------------
def _cmd_check(args: argparse.Namespace) -> int:
    from mpk.check import run_check
    from mpk.engine.job import ModelSource
    from mpk.models import get_preset, load_config

    backend = _backend(args)
    cfg = load_config(args.checkpoint) if args.checkpoint else get_preset(args.model)
    model = (cfg.name or args.checkpoint) if args.checkpoint else args.model
    layers = _check_layers(cfg) if args.layers is None else args.layers
    if layers.stop > cfg.num_layers:
        raise MpkError(f"--layers {layers.start}-{layers.stop - 1} is out of range: "
                       f"{model} has layers 0-{cfg.num_layers - 1}")
    # A preset's random weights are drawn for the slice alone (an 8B model's would not fit);
    # a checkpoint's layers are cut out of the whole model.
    weights = ModelSource(cfg, args.checkpoint).load("cpu") if args.checkpoint else None
    rows = [_check_row(r) for r in run_check(cfg, layers=layers, backend=backend,
                                             seed=args.seed, weights=weights, batch=args.batch)]
    failed = [r for r in rows if not r["passed"]]
    if args.json:
        print(json.dumps({"model": model, "backend": backend, "seed": args.seed,
                          "batch": args.batch,
                          "layers": [layers.start, layers.stop - 1], "rows": rows,
                          "passed": not failed}))
    else:
        # A whole model gives ~16 rows per layer: past a screenful, the failures and the
        # closest passes tell the story (--json has every row).
        shown = rows if len(rows) <= CHECK_ROWS_SHOWN else failed + sorted(
            (r for r in rows if r["passed"]), key=lambda r: -r["rel_err"])[:10]
        batch = f", batch {args.batch}" if args.batch > 1 else ""
        _console().print(_table(
            f"{model} layers {layers.start}-{layers.stop - 1}{batch}: {backend} vs the "
            f"interpreter, layer by layer" + ("" if shown is rows else
                                              " (failures and the 10 closest passes)"),
            ("tensor", "rel err", "tolerance", "ok"),
            [(r["tensor"], f"{r['rel_err']:.2e}", f"{r['tolerance']:.0e}",
              "yes" if r["passed"] else "NO") for r in shown]))
        print(f"{len(rows) - len(failed)} of {len(rows)} tensors within tolerance")
    return 1 if failed else 0


def _check_layers(cfg: ModelConfig) -> range:
    """mpk check's default --layers: layer 0, and for a MoE model with both kinds of layer
    (dense MLP, experts) the layers up to the first one of the other kind."""
    kind = cfg.is_moe_layer(0)
    other = next((i for i in range(cfg.num_layers) if cfg.is_moe_layer(i) != kind), 0)
    return range(other + 1)


def _check_row(row: Any) -> dict[str, Any]:
    """A run_check row (mpk.check.CheckRow, or a plain tuple in the same order) as a dict."""
    keys = ("tensor", "rel_err", "tolerance", "passed")
    values = [getattr(row, k) for k in keys] if hasattr(row, "rel_err") else list(row)
    return {"tensor": str(values[0]), "rel_err": float(values[1]), "tolerance": float(values[2]),
            "passed": bool(values[3])}
