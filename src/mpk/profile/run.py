"""`mpk profile`: a timestamped launch of a model's decode step on the GPU, and its reports.

profile_model compiles the model exactly as the benchmark does (mpk.bench.mpk_decoder: the same
decode shape, weights, prompt and rewind to the same position per launch), then runs two
executors of that one Plan over the same device tensors (weights, KV cache, io):
  * the default build, timed with CUDA events as `mpk bench` times it;
  * the profiling build: a warm-up launch, then the profiled launch of `steps` steps whose stamps
    become the reports, then the same event timing, so the profiling overhead is measured.
write_reports turns a Timeline into trace.json, sm_timeline.png and kinds.json (the kind table
and the dependency chain's phases, mpk.profile.phases; CPU only).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpk.compiler.plan import Plan
from mpk.models.config import ModelConfig
from mpk.profile.phases import PhaseRow, phase_rows, phases_json
from mpk.profile.picture import draw_timeline
from mpk.profile.table import KindTable, kind_table
from mpk.profile.timeline import Timeline, from_stamps
from mpk.profile.trace import write_trace

TRACE_FILE = "trace.json"
PICTURE_FILE = "sm_timeline.png"
KINDS_FILE = "kinds.json"
PAGE_SIZE = 16  # as MpkDecoder
# The trace and the picture show the launch's first steps only: a 0.6B model runs ~17k tasks per
# step, so 32 steps would be a ~300 MB trace and a picture of sub-pixel tasks. The table uses all.
WINDOW_STEPS = 4
# Above this the %globaltimer ticks are too coarse for microsecond tasks: say so in the report.
COARSE_TIMER_NS = 200


@dataclass
class ProfileResult:
    out_dir: Path
    plan: Plan
    timeline: Timeline
    table: KindTable
    summary: dict[str, Any]  # what kinds.json holds
    timing: dict[str, Any] = field(default_factory=dict)
    phases: list[PhaseRow] = field(default_factory=list)


def write_reports(tl: Timeline, out_dir: str | Path, *, bandwidth_bytes_per_s: float | None = None,
                  title: str | None = None, extra: dict[str, Any] | None = None,
                  window_steps: int = WINDOW_STEPS,
                  phases: list[PhaseRow] | None = None) -> tuple[KindTable, dict[str, Any]]:
    """Write trace.json and sm_timeline.png (the first `window_steps` steps) and kinds.json (all
    steps) for `tl` into `out_dir`; returns the kind table and the summary written to kinds.json
    (`extra` is merged into it)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    window = tl.first_steps(window_steps)
    write_trace(window, out / TRACE_FILE, title=title)
    shown = f"first {window.num_steps} of {tl.num_steps} steps"
    draw_timeline(window, out / PICTURE_FILE, title=f"{title} ({shown})" if title else None)
    table = kind_table(tl, bandwidth_bytes_per_s)
    resolution = tl.timer_resolution_ns()
    summary: dict[str, Any] = {
        "files": {"trace": str(out / TRACE_FILE), "picture": str(out / PICTURE_FILE),
                  "kinds": str(out / KINDS_FILE)},
        "num_sms": tl.plan.num_sms, "num_steps": tl.num_steps, "step_begin": tl.step_begin,
        "window_steps": window.num_steps,
        "events": len(tl), "missing_records": tl.missing,
        "stamps_ms_per_step": tl.ns_per_step / 1e6, "timer_resolution_ns": resolution,
        "timer_coarse": resolution is not None and resolution > COARSE_TIMER_NS,
        **(extra or {}), "kinds": table.to_json(),
        "phases": phases_json(phase_rows(tl) if phases is None else phases, tl.num_steps),
    }
    (out / KINDS_FILE).write_text(json.dumps(summary, indent=1, default=str))
    return table, summary


def profile_model(cfg: ModelConfig, steps: int = 200, *, weights: dict[str, Any] | None = None,
                  batch: int = 1, seed: int = 0, out_dir: str | Path = "mpk-profile",
                  num_sms: int | None = None, repeats: int = 5, prompt_len: int = 16,
                  measure_bandwidth: bool = True, plan_positions: int = 0,
                  extra_includes: tuple[Path, ...] = ()) -> ProfileResult:
    """Profile `steps` decode steps of `cfg` on the current CUDA device (see the module doc).
    `weights`: HF-named tensors (default: random_weights(cfg, seed) on the GPU).
    `plan_positions`: compile the plan for at least this many KV positions a row (a long-context
    plan, with its attention's KV splits, profiled at the short context of the run).
    `extra_includes`: include directories searched first by the PROFILED build only (patched
    kernel headers: scripts/probe_model.py); the default build stays the product's."""
    import torch

    from mpk.backends.cuda.executor import CudaExecutor
    from mpk.bench.runner import bench_prompt
    from mpk.bench.timing import read_bandwidth_probe, require_cuda, summarize, time_decode
    from mpk.compiler.cache import compile_cached
    from mpk.engine.bind import bind_model
    from mpk.models.builder import DecodeShape, build_graph
    from mpk.models.weights import random_weights

    require_cuda("mpk profile")
    device = torch.device("cuda", torch.cuda.current_device())
    if weights is None:
        weights = random_weights(cfg, seed, device)
    num_sms = num_sms or torch.cuda.get_device_properties(device).multi_processor_count
    prompt = bench_prompt(cfg, batch, prompt_len, seed)
    pages = -(-max(prompt_len + steps + 1, plan_positions) // PAGE_SIZE)
    shape = DecodeShape(batch=batch, steps_per_launch=max(prompt_len, steps),
                        page_size=PAGE_SIZE, max_pages=pages, num_pages=batch * pages)
    t0 = time.perf_counter()
    plan = compile_cached(build_graph(cfg, shape, num_sms=num_sms), num_sms)
    t1 = time.perf_counter()
    plain = CudaExecutor(plan, device)
    profiled = CudaExecutor(plan, device, profile=True, extra_includes=extra_includes)
    build_s = time.perf_counter() - t1
    bind_model(plain, plan, cfg, shape, weights, seed=0)
    for t in plan.tensors:  # one set of weights, KV cache and io buffers for both builds
        if t.role in ("weight", "io"):
            profiled.bind(t.name, plain.tensor(t.name))

    # The prompt, then every launch restarts right after it (as MpkDecoder does).
    forced = torch.full((shape.steps_per_launch, batch), -1, dtype=torch.int32)
    forced[:prompt_len] = prompt.T.int()
    plain.write("prompt", forced)
    plain.run(prompt_len)
    plain.write("prompt", torch.full_like(forced, -1))
    start = torch.full((batch,), prompt_len, dtype=torch.int32)

    def launcher(ex: CudaExecutor) -> Any:
        def launch(n: int) -> None:
            ex.write("positions", start)
            ex.run(n)
        return launch

    launcher(plain)(steps)  # warm-ups: caches, clocks, the allocator's profile buffer
    launcher(profiled)(steps)
    launcher(profiled)(steps)  # the profiled launch whose stamps make the reports
    stamps, step_begin = profiled.last_profile()
    # Timed as `mpk bench` times MPK (time_decode: events around write + run), the two builds
    # alternating so that clock or thermal drift does not land on one of them.
    plain_runs: list[float] = []
    prof_runs: list[float] = []
    for _ in range(repeats):
        plain_runs += time_decode(launcher(plain), steps, warmup=0, repeats=1)["runs_ms"]
        prof_runs += time_decode(launcher(profiled), steps, warmup=0, repeats=1)["runs_ms"]
    plain_t, prof_t = summarize(plain_runs), summarize(prof_runs)
    bandwidth = read_bandwidth_probe(device) if measure_bandwidth else None

    tl = from_stamps(stamps, plan, step_begin)
    plain_ms, prof_ms = plain_t["median_ms"], prof_t["median_ms"]
    timing = {
        "ms_per_token": plain_ms, "ms_per_token_p10": plain_t["p10_ms"],
        "ms_per_token_p90": plain_t["p90_ms"], "profiled_ms_per_token": prof_ms,
        "profiling_overhead_pct": 100.0 * (prof_ms / plain_ms - 1.0),
        "stamps_ms_per_token": tl.ns_per_step / 1e6, "repeats": repeats,
        "plan_s": t1 - t0, "build_s": build_s,
    }
    extra = {"model": cfg.name or cfg.arch, "batch": batch, "steps": steps, "seed": seed,
             "device": torch.cuda.get_device_name(device), "timing": timing,
             "bandwidth_bytes_per_s": bandwidth}
    title = f"{cfg.name or cfg.arch} batch {batch}: {steps} steps on {num_sms} SMs"
    phases = phase_rows(tl)
    table, summary = write_reports(tl, out_dir, bandwidth_bytes_per_s=bandwidth, title=title,
                                   extra=extra, phases=phases)
    return ProfileResult(Path(out_dir), plan, tl, table, summary, timing, phases)


def summary_lines(result: ProfileResult) -> list[str]:
    """The human lines printed after the table: files, timing against the bench, overhead."""
    s, t = result.summary, result.timing
    lines = [(f"trace: {s['files']['trace']} (open in https://ui.perfetto.dev) and picture: "
              f"{s['files']['picture']} (first {s['window_steps']} steps); table: "
              f"{s['files']['kinds']} (all {s['num_steps']} steps)")]
    if t:
        lines.append(
            f"default build: {t['ms_per_token']:.3f} ms/token (median of {t['repeats']}, p10 "
            f"{t['ms_per_token_p10']:.3f}, p90 {t['ms_per_token_p90']:.3f}; timed as mpk bench); "
            f"profiling build: {t['profiled_ms_per_token']:.3f} ms/token = "
            f"{t['profiling_overhead_pct']:+.1f}% overhead; stamps span "
            f"{t['stamps_ms_per_token']:.3f} ms/token")
    if s.get("timer_coarse"):
        lines.append(f"WARNING: %globaltimer advances in {s['timer_resolution_ns']} ns steps "
                     f"here: per-task times shorter than that are unreliable")
    if s.get("missing_records"):
        lines.append(f"WARNING: {s['missing_records']} records have no stamps")
    return lines
