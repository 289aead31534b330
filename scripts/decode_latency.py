"""First latency measurement on the GPU: MPK ms/token at batch 1 against torch.compile on the
same random weights in the same process (prompt of 16 tokens, then timed greedy steps).

    python3 scripts/decode_latency.py qwen3-0.6b llama-3.2-1b
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from mpk.backends.base import create_executor
from mpk.compiler.lower import compile_graph
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import get_preset
from mpk.models.weights import random_weights
from mpk.check import bind_model

PROMPT, STEPS, REPEATS = 16, 64, 3


def mpk_ms_per_token(cfg, weights) -> tuple[float, dict]:
    shape = DecodeShape(batch=1, steps_per_launch=STEPS, page_size=16, max_pages=16,
                        num_pages=16)
    t0 = time.perf_counter()
    plan = compile_graph(build_graph(cfg, shape, num_sms=132), 132)
    ex = create_executor(plan, "cuda")
    build_s = time.perf_counter() - t0
    bind_model(ex, plan, cfg, shape, weights, seed=0)
    prompt = torch.full((STEPS, 1), -1, dtype=torch.int32)
    prompt[:PROMPT, 0] = torch.randint(0, cfg.vocab_size, (PROMPT,), dtype=torch.int32)
    ex.write("prompt", prompt)
    ex.run(PROMPT)  # warm-up: prompt processing
    ex.write("prompt", torch.full((STEPS, 1), -1, dtype=torch.int32))
    times = []
    for r in range(REPEATS):
        ex.write("positions", torch.tensor([PROMPT + r * STEPS], dtype=torch.int32))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        ex.run(STEPS)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / STEPS)
    return statistics.median(times), {"plan_and_build_s": round(build_s, 1), **plan.meta}


def baseline_ms_per_token(cfg, weights) -> float | None:
    try:
        from mpk.bench.baseline import StaticDecoder, compile_step
    except ImportError as e:
        print("baseline unavailable:", e)
        return None
    model = StaticDecoder(cfg, weights, max_seq=PROMPT + STEPS * REPEATS + 8, batch=1)
    step = compile_step(model)
    tok = torch.zeros(1, dtype=torch.long, device="cuda")
    for p in range(PROMPT):
        torch.compiler.cudagraph_mark_step_begin()
        tok = step(tok, torch.tensor(p, device="cuda")).clone()
    times = []
    pos = PROMPT
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(STEPS):
            torch.compiler.cudagraph_mark_step_begin()
            tok = step(tok, torch.tensor(pos, device="cuda")).clone()
            pos += 1
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / STEPS)
    return statistics.median(times)


def main(models: list[str]) -> None:
    rows = []
    for name in models:
        cfg = get_preset(name)
        weights = random_weights(cfg, seed=0, device="cuda")
        ms, meta = mpk_ms_per_token(cfg, weights)
        floor = meta["weight_bytes_per_step"] / 4.0e9
        try:
            base = baseline_ms_per_token(cfg, weights)
        except Exception as e:  # the baseline must not hide MPK's number
            print(f"baseline failed for {name}: {type(e).__name__}: {e}")
            base = None
        rows.append((name, ms, floor, base, meta["predicted_us_per_step"] / 1000))
        print(f"{name}: mpk {ms:.3f} ms/token, floor {floor:.3f}, baseline {base}, "
              f"predicted {meta['predicted_us_per_step'] / 1000:.3f}, build {meta['plan_and_build_s']} s",
              flush=True)
        del weights
        torch.cuda.empty_cache()
    print("\n| model | MPK ms/token | torch.compile ms/token | ratio | % of floor | predicted |")
    print("|---|---|---|---|---|---|")
    for name, ms, floor, base, pred in rows:
        ratio = f"{base / ms:.2f}x" if base else "-"
        b = f"{base:.3f}" if base else "-"
        print(f"| {name} | {ms:.3f} | {b} | {ratio} | {100 * floor / ms:.0f}% | {pred:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3-0.6b"])
