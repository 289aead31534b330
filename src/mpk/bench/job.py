"""`mpk bench` as plain data, so that one process or G tensor-parallel processes run it.

With G > 1 every rank (one GPU each, mpk.parallel.launch) compiles its share of the model and
makes the same MPK launches; rank 0 also runs the torch.compile baseline on its own GPU first
(the others wait at the first launch's barrier) and reports. The baseline is always the
single-GPU recipe: the question a user asks is whether G GPUs beat one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpk.bench.mpk_decoder import MpkDecoder
from mpk.bench.runner import REPEATS, WARMUP, bench_prompt, run_bench
from mpk.bench.timing import time_decode
from mpk.engine.job import ModelSource
from mpk.parallel.launch import run_ranks
from mpk.parallel.tp import TensorParallel

CHECK_TOKENS = 16  # greedy tokens of row 0 compared between MPK and the baseline
PROMPT_LEN = 16


@dataclass(frozen=True)
class BenchJob:
    source: ModelSource
    batch: int = 1
    new_tokens: int = 200


def run_bench_job(job: BenchJob, tp_size: int = 1) -> dict[str, Any]:
    """The bench result of rank 0 (see runner.run_bench), with the MPK compile times, the
    token agreement and the tensor-parallel size."""
    if tp_size > 1:
        TensorParallel(0, tp_size).check(job.source.cfg)
    return run_ranks(tp_size, _bench_rank, job, backend="cuda")


def _bench_rank(tp: TensorParallel, job: BenchJob) -> dict[str, Any] | None:
    cfg = job.source.cfg
    weights = job.source.load("cuda")
    prompt = bench_prompt(cfg, job.batch, PROMPT_LEN, job.source.seed)
    decoder = MpkDecoder(cfg, weights, prompt, job.new_tokens,
                         tp=tp if tp.size > 1 else None)
    # run_bench lists the baseline's first min(CHECK_TOKENS, new_tokens) tokens: as many here.
    mpk_tokens = decoder.tokens(min(CHECK_TOKENS, job.new_tokens))
    if tp.rank != 0:
        # Exactly rank 0's MPK launches (run_bench times them the same way), so that every
        # launch finds its peers.
        time_decode(decoder.step, job.new_tokens, warmup=WARMUP, repeats=REPEATS)
        return None
    result = run_bench(cfg, job.batch, job.new_tokens, job.source.seed, decoder.step,
                       weights=weights, prompt_len=PROMPT_LEN, check_tokens=CHECK_TOKENS)
    result.update(tp=tp.size, mpk_plan_s=round(decoder.plan_s, 2),
                  mpk_build_s=round(decoder.build_s, 2), mpk_tokens=mpk_tokens,
                  tokens_agree=tokens_agree(mpk_tokens, result["baseline_tokens"]))
    return result


def tokens_agree(mpk_tokens: list[int], baseline_tokens: list[int]) -> str:
    """"same/n": how many of the n positions hold the same token. The lists must cover the
    same positions (the first generated token onwards), hence the same length: zip would
    silently compare a shorter list against a shifted one."""
    if len(mpk_tokens) != len(baseline_tokens):
        raise ValueError(f"token lists of different lengths: MPK {len(mpk_tokens)}, "
                         f"baseline {len(baseline_tokens)}")
    same = sum(a == b for a, b in zip(mpk_tokens, baseline_tokens, strict=True))
    return f"{same}/{len(mpk_tokens)}"
