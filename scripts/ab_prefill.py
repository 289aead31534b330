"""MPK's prefill alone (no torch): `mpk bench --prefill`'s MPK half on seeded random weights, for
A/B runs of source trees on one machine in one call.

    python3 scripts/ab_prefill.py --model qwen3-8b --prompt 2048 --chunk 2048   # one JSON line

Run it once per tree with PYTHONPATH=<tree>/src and a MPK_CACHE_DIR of its own (as
scripts/ab_decode.py says). The engine is the one `mpk bench --prefill` times (the serving engine
with `--max-batch` rows and a prefill plan of `--chunk` positions a launch); the line holds the
tree's mpk path, `--rounds` medians of the time to the first token (each the median of 5 after a
warm-up, bench/prefill.time_mpk_prefill) and that token (equal across trees unless the arithmetic
changed). Without torch's baseline a cold run skips building and timing a second copy of the
model.
"""

from __future__ import annotations

import argparse
import json

import torch

import mpk
from mpk.bench.prefill import random_prompt, time_mpk_prefill
from mpk.engine.engine import Engine
from mpk.models.config import get_preset
from mpk.models.weights import random_weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    p.add_argument("--chunk", type=int, default=2048, help="prefill positions a launch")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backend", default="cuda", help="cpu: a quick check of the script itself")
    args = p.parse_args()
    cfg = get_preset(args.model)
    device = torch.device("cuda", 0) if args.backend == "cuda" else torch.device("cpu")
    weights = random_weights(cfg, 0, device)
    prompt = random_prompt(cfg.vocab_size, args.prompt, 0)
    engine = Engine(cfg, weights, backend=args.backend, max_seq_len=args.prompt + 16,
                    prefill_rows=args.max_batch, prefill_chunk=args.chunk, progress=False)
    rounds = [time_mpk_prefill(engine, prompt, args.max_batch, repeats=5)
              for _ in range(args.rounds)]
    print(json.dumps({"src": mpk.__file__, "model": args.model, "prompt": args.prompt,
                      "chunk": args.chunk, "ms": [round(ms, 3) for ms, _, _ in rounds],
                      "token": rounds[0][1], "steps": rounds[0][2]}), flush=True)


if __name__ == "__main__":
    main()
