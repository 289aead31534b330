"""`mpk bench --serving`: the serving engine under a seeded request trace.

The trace (make_trace): `requests` greedy requests with log-uniform prompt and output lengths,
random token ids, and Poisson arrival offsets at `rate` requests/s (rate 0: all at once), all
drawn from one seed, so a run replays exactly.

Over one started engine (one compiled plan of `max_batch` rows):
  single      one request alone decoding RATE_LAUNCHES launches' worth of tokens: the
              single-request decode rate (the tokens delivered after the first token's launch
              / the time from it to the last token: a launch's tokens arrive together, so the
              rate needs several launches, and the tokens that came with the first are not
              counted);
  solo        each request alone (the other slots empty): its tokens;
  concurrent  the trace replayed at its arrival times: per-request TTFT, time per output token
              after the first (TPOT) and the gaps between token deliveries (zero inside a
              launch, whose tokens arrive together),
              the total output tokens/s over the run, and whether every request's tokens equal
              its solo run's (a row's arithmetic does not depend on the rows beside it, so they
              must be identical, not merely close).
  full batch  `max_batch` requests at once with short prompts (the trace's first prompts, cut to
              FULL_PROMPT tokens), each decoding RATE_LAUNCHES launches' worth: the total decode
              tokens/s while every slot decodes (tokens delivered between the last request's
              first token and the first request's last, over that window), against one
              request alone with the same short prompt (the same context length: attention's
              cost per step grows with it; its rate counted the same way) -- the serving
              issue's "16 concurrent requests" ratio.
The headline ratio is the concurrent output tokens/s over the single-request decode rate; the
trace's prompts and arrivals are part of it, the full-batch ratio is decoding alone.
`launch_split` says, for the single and the concurrent pass (and the full batch's two passes,
under full_batch), how much of the wall time was spent inside launches (per step) and how much on
the host between them, and how many prompts each prefill-plan launch packed.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

from mpk.engine.engine import Engine
from mpk.engine.requests import RequestHandle, SamplingParams

RATE_LAUNCHES = 8
FULL_PROMPT = 8  # prompt tokens of the full-batch requests (short: their decoding is measured)


@dataclass(frozen=True)
class Trace:
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]
    arrivals_s: tuple[float, ...]  # offsets from the start of the run, non-decreasing


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def make_trace(vocab_size: int, requests: int, prompt_len: tuple[int, int],
               output_len: tuple[int, int], rate: float, seed: int) -> Trace:
    """A seeded trace (see the module doc); lengths are inclusive ranges, both >= 1."""
    rng = random.Random(seed)
    prompts, outputs, arrivals, t = [], [], [], 0.0
    for _ in range(requests):
        n = _log_uniform(rng, *prompt_len)
        prompts.append(tuple(rng.randrange(vocab_size) for _ in range(n)))
        outputs.append(_log_uniform(rng, *output_len))
        arrivals.append(t)
        t += rng.expovariate(rate) if rate > 0 else 0.0
    return Trace(tuple(prompts), tuple(outputs), tuple(arrivals))


def positions_needed(trace: Trace, steps_per_launch: int) -> int:
    """The max_seq_len an engine needs for the trace, the single-request probe and the full
    batch."""
    probe = max(len(trace.prompts[0]), FULL_PROMPT) + RATE_LAUNCHES * steps_per_launch
    return max(probe, *(len(p) + n for p, n in zip(trace.prompts, trace.max_tokens,
                                                    strict=True)))


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p99_ms": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)

    return {"p50_ms": at(0.50), "p99_ms": at(0.99)}


def window_rate(times: list[list[float]]) -> tuple[float, float, int, float | None]:
    """Decode tokens/s of requests decoding together: the tokens delivered after the last
    request's first token, up to the first request's last, over that window (start, end,
    tokens, rate). A launch's tokens arrive together, so tokens delivered WITH a first token
    were made before the window opened and are not counted (a launch that feeds an 8-token
    prompt delivers the first token and 8 more at once)."""
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    counted = sum(1 for t in times for at in t if start < at <= end)
    return start, end, counted, (counted / (end - start) if end > start else None)


def _decode_rate(handle: RequestHandle) -> float | None:
    times = handle.result().stats.token_times
    return window_rate([times])[3] if times else None


def _wall_s(handle: RequestHandle) -> float:
    """Seconds from the request's submission to its last token."""
    stats = handle.result().stats
    return stats.token_times[-1] - stats.submitted


def _solo(engine: Engine, trace: Trace) -> list[RequestHandle]:
    handles = []
    for prompt, max_tokens in zip(trace.prompts, trace.max_tokens, strict=True):
        handle = engine.submit(list(prompt), SamplingParams(max_tokens=max_tokens))
        handle.result()
        handles.append(handle)
    return handles


def _concurrent(engine: Engine, trace: Trace) -> tuple[list[RequestHandle], float]:
    start = time.perf_counter()
    handles = []
    for prompt, max_tokens, at in zip(trace.prompts, trace.max_tokens, trace.arrivals_s,
                                      strict=True):
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        handles.append(engine.submit(list(prompt), SamplingParams(max_tokens=max_tokens)))
    for handle in handles:
        handle.result()
    return handles, time.perf_counter() - start


def _full_batch(engine: Engine, trace: Trace, max_batch: int, tokens: int) -> dict[str, Any]:
    """Decode tokens/s with every one of `max_batch` slots decoding, and of the first of those
    requests alone (module docstring); each pass's launch split."""
    prompts = tuple(trace.prompts[i % len(trace.prompts)][:FULL_PROMPT] for i in range(max_batch))
    launches = engine.scheduler.stats.launch_times
    since = len(launches)
    alone = _solo(engine, Trace(prompts[:1], (tokens,), (0.0,)))[0]
    alone_times, since = launches[since:], len(launches)
    handles, wall_s = _concurrent(engine, Trace(prompts, (tokens,) * max_batch,
                                                (0.0,) * max_batch))
    full_times = launches[since:]
    start, end, counted, rate = window_rate([h.result().stats.token_times for h in handles])
    alone_rate = _decode_rate(alone)
    return {"requests": max_batch, "tokens_each": tokens, "window_s": round(end - start, 6),
            "tokens_in_window": counted,
            "decode_tokens_per_s": None if rate is None else round(rate, 2),
            "single_tokens_per_s": None if alone_rate is None else round(alone_rate, 2),
            "speedup_over_single": (None if rate is None or not alone_rate
                                    else round(rate / alone_rate, 2)),
            "launch_split": {
                "alone": _launch_split(alone_times, _wall_s(alone), []),
                "all_slots": _launch_split(full_times, wall_s, [])}}


def _launch_split(times: list[tuple[float, float, int]], wall_s: float,
                  pieces: list[int]) -> dict[str, Any]:
    """Where a pass's wall time went: inside launches (the kernel, its tokens read back) or
    between them (the host: admission, token delivery, writing the next launch's inputs); and
    how many prompts each of its prefill-plan launches packed (`pieces`)."""
    inside = sum(end - start for start, end, _ in times)
    steps = sum(n for _, _, n in times)
    gaps = [later[0] - earlier[1] for earlier, later in zip(times, times[1:])]
    return {"launches": len(times), "steps": steps, "in_launches_s": round(inside, 3),
            "between_launches_s": round(max(0.0, wall_s - inside), 3),
            "ms_per_step_in_launches": round(inside / steps * 1e3, 3) if steps else None,
            "gap_between_launches": _percentiles(gaps), "prefill_launches": len(pieces),
            "prompts_per_prefill_launch": round(sum(pieces) / len(pieces), 2) if pieces else None}


def run_serving_bench(engine: Engine, trace: Trace, max_batch: int) -> dict[str, Any]:
    """Both passes over `engine` (started here with `max_batch` slots, stopped after)."""
    engine.start(max_batch=max_batch)
    launches = engine.scheduler.stats.launch_times  # appended by the serving thread
    pieces = engine.scheduler.stats.prefill_pieces
    try:
        tokens = RATE_LAUNCHES * engine.options.steps_per_launch
        probe = Trace(trace.prompts[:1], (tokens,), (0.0,))
        _solo(engine, probe)  # warm-up: first launches of each plan, clocks
        since, since_pieces = len(launches), len(pieces)
        single = _solo(engine, probe)[0]
        single_times, single_pieces = launches[since:], pieces[since_pieces:]
        solo = _solo(engine, trace)
        since, since_pieces = len(launches), len(pieces)
        concurrent, wall_s = _concurrent(engine, trace)
        concurrent_times, concurrent_pieces = launches[since:], pieces[since_pieces:]
        full = _full_batch(engine, trace, max_batch, tokens)
    finally:
        engine.stop()
    single_wall = _wall_s(single)
    tokens = sum(len(h.result().token_ids) for h in concurrent)
    mismatched = [i for i, (a, b) in enumerate(zip(solo, concurrent, strict=True))
                  if a.result().token_ids != b.result().token_ids]
    stats = [h.result().stats for h in concurrent]
    solo_rate = _decode_rate(single)
    rate = tokens / wall_s if wall_s > 0 else None
    return {
        "requests": len(trace.prompts), "max_batch": max_batch,
        "prompt_tokens": sum(map(len, trace.prompts)), "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": None if rate is None else round(rate, 2),
        "single_request_tokens_per_s": None if solo_rate is None else round(solo_rate, 2),
        "speedup_over_single": (None if rate is None or not solo_rate
                                else round(rate / solo_rate, 2)),
        "ttft": _percentiles([s.ttft_s for s in stats if s.ttft_s is not None]),
        "tpot": _percentiles([s.tpot_s for s in stats if s.tpot_s is not None]),
        "inter_token": _percentiles([g for s in stats for g in s.inter_token_s]),
        "outputs_equal_solo": not mismatched, "mismatched_requests": mismatched,
        "full_batch": full,
        "launch_split": {"single": _launch_split(single_times, single_wall, single_pieces),
                         "concurrent": _launch_split(concurrent_times, wall_s,
                                                     concurrent_pieces)},
    }


def format_report(result: dict[str, Any]) -> list[str]:
    """Human-readable lines of a run_serving_bench result."""
    ttft, tpot, itl = result["ttft"], result["tpot"], result["inter_token"]
    same = ("every request's tokens equal its solo run" if result["outputs_equal_solo"] else
            f"{len(result['mismatched_requests'])} requests differ from their solo run: "
            f"{result['mismatched_requests'][:8]}")
    return [
        f"{result['requests']} requests ({result['prompt_tokens']} prompt, "
        f"{result['output_tokens']} output tokens) on {result['max_batch']} slots in "
        f"{result['wall_s']:.2f} s",
        f"output tokens/s: {result['output_tokens_per_s']} concurrent, "
        f"{result['single_request_tokens_per_s']} decoding one request alone "
        f"(x{result['speedup_over_single']})",
        f"TTFT p50 {ttft['p50_ms']} ms, p99 {ttft['p99_ms']} ms; time per output token p50 "
        f"{tpot['p50_ms']} ms, p99 {tpot['p99_ms']} ms; gaps between deliveries p50 "
        f"{itl['p50_ms']} ms, p99 {itl['p99_ms']} ms",
        same,
        f"decoding on all {result['full_batch']['requests']} slots: "
        f"{result['full_batch']['decode_tokens_per_s']} tokens/s "
        f"(x{result['full_batch']['speedup_over_single']} one request's "
        f"{result['full_batch']['single_tokens_per_s']} with the same prompt)",
        *(f"{name}: {split['launches']} launches, {split['steps']} steps, "
          f"{split['in_launches_s']} s in launches ({split['ms_per_step_in_launches']} ms a "
          f"step), {split['between_launches_s']} s between (gap p50 "
          f"{split['gap_between_launches']['p50_ms'] or '-'} ms); "
          f"{split['prefill_launches']} prefill launches, "
          f"{split['prompts_per_prefill_launch'] or '-'} prompts each"
          for name, split in [*result["launch_split"].items(),
                              *((f"full batch, {k.replace('_', ' ')}", v) for k, v in
                                result["full_batch"]["launch_split"].items())]),
    ]
