"""MPK's decode alone (no torch.compile): `mpk bench`'s MPK half on seeded random weights, for
A/B runs of two source trees on one machine in one call.

    python3 scripts/ab_decode.py --model qwen3-8b --build-only   # nvcc only (no GPU needed)
    python3 scripts/ab_decode.py --model qwen3-8b                # one JSON line

Run it once per tree with PYTHONPATH=<tree>/src (and a MPK_CACHE_DIR of its own: the plan and
build caches key on the source, but separate folders keep the trees' builds apart), e.g. HEAD's
from `git archive HEAD src | tar -x -C /tmp/base`. `--build-only` compiles the exact plan the
timed run asks for on a GPU of the Graph's default SM count (the H200's 132; bench.mpk_decoder
.decode_shape), so several trees' and models' nvcc builds can run in parallel first. The line
holds the tree's mpk path, the ring's pages, `--rounds` medians of ms/token (each: 1 warm-up +
3 timed runs of `--new-tokens` steps, CUDA events) and row 0's first greedy tokens (as many as
mpk bench checks; identical across trees unless the arithmetic changed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

import mpk
from mpk.backends.cuda import build, codegen
from mpk.bench.job import CHECK_TOKENS, PROMPT_LEN
from mpk.bench import mpk_decoder
from mpk.bench.mpk_decoder import MpkDecoder
from mpk.bench.runner import bench_prompt
from mpk.bench.timing import time_decode
from mpk.compiler.cache import compile_cached
from mpk.graph.graph import DEFAULT_NUM_SMS
from mpk.models import builder
from mpk.models.config import ModelConfig, get_preset
from mpk.models.weights import random_weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=50)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN,
                   help="positions before the timed steps (a long one: a plan with KV splits)")
    p.add_argument("--max-pages", type=int, default=None,
                   help="cap the weight ring (codegen.MAX_PAGES) to time a shallower one")
    p.add_argument("--split-positions", type=int, default=None,
                   help="KV positions per attention split (models.builder.SPLIT_POSITIONS) to "
                        "time more splits at a short context")
    p.add_argument("--plan-positions", type=int, default=None,
                   help="compile the plan for this many KV positions (at least the prompt and "
                        "the new tokens): a long-context plan timed at a shorter context")
    p.add_argument("--build-only", action="store_true")
    args = p.parse_args()
    if args.max_pages is not None:
        codegen.MAX_PAGES = args.max_pages
    if args.split_positions is not None:
        builder.SPLIT_POSITIONS = args.split_positions
    if args.plan_positions is not None:
        _plan_positions(args.plan_positions)
    cfg = get_preset(args.model)
    t0 = time.perf_counter()
    if args.build_only:
        shape = mpk_decoder.decode_shape(args.batch, args.prompt_len, args.new_tokens)
        graph = builder.build_graph(cfg, shape, num_sms=DEFAULT_NUM_SMS)
        plan = compile_cached(graph, DEFAULT_NUM_SMS)
        result = build.build_plan(plan)
        print(json.dumps({"src": mpk.__file__, "model": args.model, "cached": result.cached,
                          "splits": _splits(plan), "s": round(time.perf_counter() - t0, 1),
                          "ptxas": result.ptxas()}))
        return
    print(json.dumps(_timed(args, cfg)), flush=True)


def _timed(args: argparse.Namespace, cfg: ModelConfig) -> dict:
    weights = random_weights(cfg, 0, torch.device("cuda", 0))
    decoder = MpkDecoder(cfg, weights, bench_prompt(cfg, args.batch, args.prompt_len, 0),
                         args.new_tokens)
    tokens = decoder.tokens(CHECK_TOKENS)
    medians = [time_decode(decoder.step, args.new_tokens, warmup=1, repeats=3)["median_ms"]
               for _ in range(args.rounds)]
    return {"src": mpk.__file__, "model": args.model, "batch": args.batch,
            "prompt": args.prompt_len, "splits": _splits(decoder.plan),
            "pages": codegen.num_pages(decoder.plan.scratch_bytes),
            "ms": [round(m, 4) for m in medians], "tokens": tokens}


def _plan_positions(positions: int) -> None:
    """Make MpkDecoder's plans (and --build-only's) hold `positions` KV positions a row."""
    def shape(batch: int, prompt_len: int, new_tokens: int, page_size: int = 16):
        short = plain(batch, prompt_len, new_tokens, page_size)
        pages = max(short.max_pages, -(-positions // page_size))
        return dataclasses.replace(short, max_pages=pages, num_pages=batch * pages)

    plain = mpk_decoder.decode_shape
    mpk_decoder.decode_shape = shape


def _splits(plan) -> list[int]:
    """The plan's attention KV split counts."""
    return sorted({op.grid[2] for op in plan.ops if op.kind == "attention"})


if __name__ == "__main__":
    main()
