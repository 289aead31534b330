"""`mpk bench --prefill P`: time to first token of one P-token prompt, MPK against torch.

MPK: the serving engine with `max_batch` rows and the prompt alone, fed through the engine's
prefill plan where the backend runs one (models/prefill.py), else as a run of every row
(chunked prefill in the decode batch, tasks/runs.py): max_batch positions a step.
TTFT is from submit to the first token on the handle, the median of `repeats` after a warm-up
(which compiles the plan and builds the kernel).
torch: the baseline decoder's weights and KV cache (bench/baseline.py) over the whole prompt at
once, the way a prefill runs in PyTorch: cuBLAS GEMMs for every projection, causal SDPA (flash
attention) with GQA, the cache written for all P positions, then lm_head and argmax on the last
position; CUDA events around the call, median of `repeats` after a warm-up. Eager, not
compiled: at P tokens per call the GEMMs dominate.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

import torch
import torch.nn.functional as F

from mpk.bench.baseline import StaticDecoder, _rms_norm
from mpk.engine.engine import Engine
from mpk.engine.requests import SamplingParams


def random_prompt(vocab_size: int, tokens: int, seed: int) -> list[int]:
    """The seeded prompt `mpk bench --prefill` times (and scripts/ab_prefill.py, seed 0)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(tokens)]


@torch.no_grad()
def torch_prefill(model: StaticDecoder, tokens: torch.Tensor) -> torch.Tensor:
    """Run tokens [P] (long, on the model's device) from position 0: writes the KV cache of
    row 0 for positions 0 .. P-1 and returns the greedy next token ([] long)."""
    cfg = model.cfg
    n, d, h = tokens.shape[0], cfg.head_dim, cfg.num_heads
    cos, sin = model.cos[:n].unsqueeze(1), model.sin[:n].unsqueeze(1)  # [P, 1, D/2]
    x = F.embedding(tokens, model.embed)
    for layer in model.layers:
        q, k, v = model.qkv(layer, _rms_norm(x, layer.input_norm, cfg.rms_eps), cos, sin)
        layer.k_cache[0, :, :n] = k.transpose(0, 1)
        layer.v_cache[0, :, :n] = v.transpose(0, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], is_causal=True,
                                             enable_gqa=True)
        x = x + F.linear(out[0].transpose(0, 1).reshape(n, h * d), layer.wo)
        x = x + model._mlp(layer, _rms_norm(x, layer.post_norm, cfg.rms_eps))
    last = _rms_norm(x[-1:], model.norm, cfg.rms_eps)
    return torch.argmax(model._head(last), dim=-1)[0]


def time_torch_prefill(model: StaticDecoder, tokens: torch.Tensor,
                       repeats: int) -> tuple[float, int]:
    """(median ms, next token) of torch_prefill, CUDA events, after one warm-up."""
    token = int(torch_prefill(model, tokens))
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch_prefill(model, tokens)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), token


def time_mpk_prefill(engine: Engine, prompt: list[int], max_batch: int,
                     repeats: int) -> tuple[float, int, int]:
    """(median TTFT ms, first token, steps per prefill) of the prompt alone on the engine."""
    engine.start(max_batch=max_batch)
    try:
        params = SamplingParams(max_tokens=1)
        token = engine.submit(prompt, params).result().token_ids[0]  # warm-up
        sched = engine.scheduler
        assert sched is not None
        steps0 = sched.stats.steps
        times = []
        for _ in range(repeats):
            result = engine.submit(prompt, params).result()
            assert result.stats.ttft_s is not None
            times.append(result.stats.ttft_s * 1e3)
        steps = (sched.stats.steps - steps0) // max(repeats, 1)
    finally:
        engine.stop()
    return statistics.median(times), token, steps


def run_prefill_bench(engine: Engine, model: StaticDecoder, prompt: list[int], max_batch: int,
                      repeats: int = 5) -> dict[str, Any]:
    mpk_ms, mpk_token, steps = time_mpk_prefill(engine, prompt, max_batch, repeats)
    tokens = torch.tensor(prompt, dtype=torch.long, device=model.device)
    torch_ms, torch_token = time_torch_prefill(model, tokens, repeats)
    path = (f"prefill plan, {engine.prefill_chunk} positions a launch" if engine.prefill_chunk
            else f"runs of {max_batch} rows")
    return {"prompt_tokens": len(prompt), "max_batch": max_batch, "mpk_path": path,
            "mpk_steps": steps,
            "mpk_ttft_ms": round(mpk_ms, 3), "torch_prefill_ms": round(torch_ms, 3),
            "mpk_over_torch": round(mpk_ms / torch_ms, 2),
            "first_token_agrees": mpk_token == torch_token}


def format_prefill(result: dict[str, Any]) -> list[str]:
    return [f"prefill of {result['prompt_tokens']} tokens: MPK {result['mpk_ttft_ms']:.1f} ms "
            f"to the first token ({result['mpk_steps']} launch steps: {result['mpk_path']}), "
            f"torch (cuBLAS + SDPA, eager) {result['torch_prefill_ms']:.1f} ms: "
            f"x{result['mpk_over_torch']} of torch; first token agrees: "
            f"{result['first_token_agrees']}"]
