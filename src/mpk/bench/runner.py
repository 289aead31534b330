"""The decode benchmark: the torch.compile baseline and (optionally) MPK on the same weights,
the same GPU and in the same process, against the measured bandwidth floor.

The baseline is rebuilt here every time instead of quoting the reference table, because clocks,
drivers and torch versions move both numbers; only the ratio from one run means something.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any

import torch

from mpk.bench.baseline import DecodeLoop, StaticDecoder, compile_step
from mpk.bench.timing import (floor_ms, percent_of_floor, read_bandwidth_probe, require_cuda,
                              time_decode)
from mpk.models.config import ModelConfig
from mpk.models.weights import random_weights
from mpk.tasks.moe_gate_up.task import expected_distinct

BASELINE = "torch.compile"
MPK = "mpk"
WARMUP = 1  # untimed runs of each system before the timed ones
REPEATS = 3  # timed runs of `new_tokens` steps; the median is reported


def weight_bytes_per_token(cfg: ModelConfig, elem_bytes: int = 2) -> int:
    """Weight bytes one decode step must read: every weight once, except that an untied
    model's embedding table is only indexed (one row, not counted); a tied table is also the
    lm_head and is read whole. KV-cache reads are left out (small at these lengths).

    A MoE layer must read at least num_experts_per_tok experts (active_params): that is the
    floor at any batch (all rows may pick the same experts); counting all experts would put
    the floor above what either system reads at batch 1."""
    untied_embed = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
    return (cfg.active_params - untied_embed) * elem_bytes


def uniform_routing_bytes_per_step(cfg: ModelConfig, batch: int, elem_bytes: int = 2) -> int:
    """Weight bytes one decode step of `batch` rows reads when every row routes uniformly: each
    MoE layer reads the expected number of distinct experts its rows choose (moe_gate_up's
    expected_distinct) instead of the K of weight_bytes_per_token. Equal to it for dense models
    and at batch 1. Random weights route nearly uniformly, so this is what the bench's MoE steps
    read at batch > 1; a trained router is skewed and reads fewer."""
    base = weight_bytes_per_token(cfg, elem_bytes)
    if not cfg.is_moe or batch <= 1:
        return base
    extra = (expected_distinct(cfg.num_experts, cfg.num_experts_per_tok, batch)
             - cfg.num_experts_per_tok)
    return base + round(cfg.num_moe_layers * extra * cfg.expert_params * elem_bytes)


def bench_prompt(cfg: ModelConfig, batch: int, prompt_len: int, seed: int) -> torch.Tensor:
    """The benchmark's prompt [batch, prompt_len] long on the CPU: seeded random ids, so MPK
    can be fed exactly the same tokens."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen)


def _system(timing: dict[str, Any], batch: int, floor: float) -> dict[str, Any]:
    med = timing["median_ms"]
    return {"median_ms": med, "p10_ms": timing["p10_ms"], "p90_ms": timing["p90_ms"],
            "runs_ms": timing["runs_ms"], "tokens_per_s": batch * 1e3 / med,
            "pct_of_floor": percent_of_floor(floor, med)}


def run_bench(cfg: ModelConfig, batch: int = 1, new_tokens: int = 200, seed: int = 0,
              mpk_step: Callable[[int], object] | None = None, *,
              weights: dict[str, torch.Tensor] | None = None, prompt_len: int = 16,
              max_seq: int = 1024, warmup: int = WARMUP, repeats: int = REPEATS,
              check_tokens: int = 16) -> dict[str, Any]:
    """Time greedy decode of `cfg` on the current CUDA device; returns a result dict.

    `weights`: HF-named tensors on the GPU; default random_weights(cfg, seed, "cuda") (pass
    your own to share them with MPK). `mpk_step(n)` must run n MPK decode steps on those same
    weights (queued or synchronous) and is called warmup + repeats times, so it has to rewind
    to the same position on each call. Each system is timed as `repeats` runs of `new_tokens`
    steps after `warmup` runs; the baseline's first steps (the prompt, fed one token per step)
    include torch.compile and CUDA-graph capture, reported as compile_s.

    The result also holds the prompt and the baseline's first `check_tokens` greedy tokens of
    row 0, so the caller can check MPK's tokens against them."""
    require_cuda("run_bench")
    device = torch.device("cuda", torch.cuda.current_device())
    if weights is None:
        weights = random_weights(cfg, seed, device)
    prompt = bench_prompt(cfg, batch, prompt_len, seed).to(device)

    model = StaticDecoder(cfg, weights, max_seq=max_seq, batch=batch)
    loop = DecodeLoop(compile_step(model), prompt, max_seq)
    skips_before = _cudagraph_skips()
    t0 = time.perf_counter()
    loop.prefill()  # compiles, warms up and records the CUDA graph
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    # Inductor falls back to plain launches (no CUDA graph) when it cannot graph the step;
    # the baseline would then be far slower than the recipe's, so the result says so.
    skips = _cudagraph_skips() - skips_before
    tokens = loop.generate(min(check_tokens, new_tokens))[0].tolist()
    base_timing = time_decode(loop.run, new_tokens, warmup=warmup, repeats=repeats)

    bandwidth = read_bandwidth_probe(device)
    nbytes = weight_bytes_per_token(cfg)
    floor = floor_ms(nbytes, bandwidth)
    routed = uniform_routing_bytes_per_step(cfg, batch)
    systems = {BASELINE: {**_system(base_timing, batch, floor), "compile_s": compile_s,
                          "cudagraph_skips": skips}}
    ratio = None
    if mpk_step is not None:
        mpk_timing = time_decode(mpk_step, new_tokens, warmup=warmup, repeats=repeats)
        systems[MPK] = _system(mpk_timing, batch, floor)
        ratio = systems[BASELINE]["median_ms"] / systems[MPK]["median_ms"]
    return {
        "model": cfg.name or cfg.arch, "batch": batch, "new_tokens": new_tokens,
        "prompt_len": prompt_len, "max_seq": max_seq, "seed": seed, "repeats": repeats,
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "bytes_per_token": nbytes, "bandwidth_bytes_per_s": bandwidth, "floor_ms": floor,
        "uniform_routing_bytes_per_step": routed,
        "uniform_routing_floor_ms": floor_ms(routed, bandwidth),
        "systems": systems, "ratio_baseline_over_mpk": ratio,
        "prompt": prompt[0].tolist(), "baseline_tokens": tokens,
    }


def _cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def format_table(result: dict[str, Any]) -> str:
    """A plain-text (rich, no colour) table of a run_bench result."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    title = (f"{result['model']}  batch {result['batch']}  {result['new_tokens']} tokens  "
             f"on {result['device']} (torch {result['torch']})")
    table = Table(title=title, box=box.SIMPLE)
    for col in ("system", "ms/token", "p10", "p90", "tokens/s", "% of floor", "compile s"):
        table.add_column(col, justify="left" if col == "system" else "right")
    table.add_row("floor", f"{result['floor_ms']:.3f}", "", "", "", "100%", "")
    for name, s in result["systems"].items():
        compile_s = s.get("compile_s")
        table.add_row(name, f"{s['median_ms']:.3f}", f"{s['p10_ms']:.3f}", f"{s['p90_ms']:.3f}",
                      f"{s['tokens_per_s']:.0f}", f"{s['pct_of_floor']:.0f}%",
                      "" if compile_s is None else f"{compile_s:.1f}")
    buf = io.StringIO()
    console = Console(file=buf, width=110, color_system=None, force_terminal=False)
    console.print(table)
    notes = [f"weights read per token: {result['bytes_per_token'] / 1e9:.3f} GB; "
             f"read bandwidth (torch.sum, 2 GiB): "
             f"{result['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s"]
    routed = result.get("uniform_routing_bytes_per_step", result["bytes_per_token"])
    if routed != result["bytes_per_token"]:
        notes.append(f"with every row routed uniformly (random weights) a step of batch "
                     f"{result['batch']} reads {routed / 1e9:.3f} GB: floor "
                     f"{result['uniform_routing_floor_ms']:.3f} ms (the table's floor counts "
                     f"only the K experts any batch must read)")
    if result["systems"].get(BASELINE, {}).get("cudagraph_skips"):
        notes.append("WARNING: inductor skipped CUDA graphs for the baseline step (see its log)")
    ratio = result.get("ratio_baseline_over_mpk")
    if ratio is not None:
        notes.append(f"speed-up of MPK over torch.compile: {ratio:.2f}x")
    return buf.getvalue().rstrip() + "\n" + "\n".join(notes) + "\n"
