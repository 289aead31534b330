#!/usr/bin/env python
"""Replay a seeded trace of requests against `mpk serve` and report throughput and latency.

The trace: --num-requests requests (200) with log-uniform prompt and output lengths and Poisson
arrivals at --rate requests/s, all drawn from --seed, so every run replays the same load. Each
request is a streamed /v1/completions call with the prompt as token ids (ids below 256 exist in
every vocabulary, and models without a tokenizer, the random-weight presets, take only ids) and
`ignore_eos`, so it produces exactly its output length.

Measured per request with the official openai client: TTFT (send to the first text chunk),
inter-token latency (gaps between chunks; a launch's tokens arrive together, so with
--steps-per-launch N most gaps are ~0 and one in N is a launch), TPOT ((end - first token) /
(tokens - 1)) and end-to-end time. Reported: p50 / p99 of each, output tokens/s and requests/s
over the run.

  # against a running server
  python scripts/bench_serve.py --url http://127.0.0.1:8000/v1 --model qwen3-8b
  # start the server, run the trace, stop the server (SIGTERM: it drains and exits 0)
  python scripts/bench_serve.py --launch "mpk serve --backend cuda --model qwen3-8b \\
      --max-batch 16 --port 0" --json --out bench-serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import openai

START_TIMEOUT_S = 1800.0  # a first start compiles the plan (and nvcc builds the kernel)


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt: list[int]
    output_len: int


@dataclass
class Outcome:
    ok: bool = False
    error: str = ""
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def tpot_s(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def make_trace(n: int, rate: float, prompt_len: tuple[int, int], output_len: tuple[int, int],
               max_len: int, seed: int) -> list[TraceRequest]:
    """n requests with Poisson arrivals and log-uniform lengths (prompt + output <= max_len)."""
    rng = random.Random(seed)

    def log_uniform(lo: int, hi: int) -> int:
        return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))

    trace, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        p = log_uniform(*prompt_len)
        o = min(log_uniform(*output_len), max_len - p + 1)
        if o < 1:
            raise SystemExit(f"a {p}-token prompt leaves no room in the {max_len}-token context: "
                             f"lower --prompt-len")
        trace.append(TraceRequest(t, [rng.randrange(256) for _ in range(p)], o))
    return trace


async def run_one(client: openai.AsyncOpenAI, model: str, req: TraceRequest,
                  start: float) -> Outcome:
    await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
    out = Outcome(prompt_tokens=len(req.prompt))
    sent = time.perf_counter()
    last = None
    try:
        stream = await client.completions.create(
            model=model, prompt=req.prompt, max_tokens=req.output_len, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if last is None:
                    out.ttft_s = now - sent
                else:
                    out.gaps_s.append(now - last)
                last = now
            if chunk.usage is not None:
                out.output_tokens = chunk.usage.completion_tokens
        out.e2e_s = time.perf_counter() - sent
        out.ok = out.output_tokens == req.output_len
        if not out.ok:
            out.error = f"{out.output_tokens} of {req.output_len} tokens"
    except openai.APIError as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    k = (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(outcomes: list[Outcome], wall_s: float, args: argparse.Namespace) -> dict:
    ok = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in ok)
    gaps = [g for o in ok for g in o.gaps_s]

    def p(values: list[float]) -> dict[str, float]:
        return {"p50_ms": round(percentile(values, 50) * 1e3, 3),
                "p99_ms": round(percentile(values, 99) * 1e3, 3)}

    return {"model": args.model, "requests": len(outcomes), "completed": len(ok),
            "failed": len(outcomes) - len(ok), "errors": sorted({o.error for o in outcomes
                                                                 if not o.ok})[:5],
            "seed": args.seed, "rate_rps": args.rate, "wall_s": round(wall_s, 3),
            "output_tokens": out_tokens, "prompt_tokens": sum(o.prompt_tokens for o in ok),
            "output_tokens_per_s": round(out_tokens / wall_s, 2) if wall_s else 0.0,
            "requests_per_s": round(len(ok) / wall_s, 3) if wall_s else 0.0,
            "ttft": p([o.ttft_s for o in ok]), "inter_token": p(gaps),
            "tpot": p([o.tpot_s for o in ok]), "e2e": p([o.e2e_s for o in ok])}


async def bench(args: argparse.Namespace, url: str) -> dict:
    client = openai.AsyncOpenAI(base_url=url, api_key=args.api_key or "none", max_retries=0,
                                timeout=args.timeout)
    models = await client.models.list()
    card = models.data[0]
    args.model = args.model or card.id
    max_len = int(getattr(card, "max_model_len", None) or 2048)
    trace = make_trace(args.num_requests, args.rate, args.prompt_len, args.output_len, max_len,
                       args.seed)
    start = time.perf_counter()
    outcomes = await asyncio.gather(*(run_one(client, args.model, r, start) for r in trace))
    wall = time.perf_counter() - start
    await client.close()
    return summarize(list(outcomes), wall, args)


def launch(command: str) -> tuple[subprocess.Popen, str]:
    """Start `mpk serve ...` and read its address from the line it prints."""
    proc = subprocess.Popen(shlex.split(command), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    for line in proc.stdout:
        if " on http://" in line:
            return proc, line.split(" on ", 1)[1].split()[0]
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit(f"the server did not start: {command}")


def length_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 1 <= LO <= HI, got {text}")
    return low, high


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server's base URL, e.g. http://127.0.0.1:8000/v1")
    where.add_argument("--launch", metavar="COMMAND",
                       help="start this `mpk serve ...` command (use --port 0), stop it after")
    p.add_argument("--model", default=None, help="model id (default: the server's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    p.add_argument("--prompt-len", type=length_range, default=(16, 1024), metavar="LO:HI")
    p.add_argument("--output-len", type=length_range, default=(16, 256), metavar="LO:HI")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="per request, seconds")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--out", default=None, help="also write the JSON report to this file")
    args = p.parse_args()
    proc = None
    url = args.url
    if args.launch:
        proc, url = launch(args.launch)
    try:
        report = asyncio.run(bench(args, url))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)  # drains, exits 0
            report_exit = proc.wait(timeout=600)
            print(f"server exited with {report_exit}", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['completed']}/{report['requests']} requests in {report['wall_s']:.1f} s: "
              f"{report['output_tokens_per_s']:.1f} output tokens/s, "
              f"{report['requests_per_s']:.2f} requests/s")
        for key in ("ttft", "inter_token", "tpot", "e2e"):
            print(f"  {key:12s} p50 {report[key]['p50_ms']:10.2f} ms   p99 "
                  f"{report[key]['p99_ms']:10.2f} ms")
        for error in report["errors"]:
            print(f"  error: {error}")
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
