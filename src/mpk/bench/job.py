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
    mpk_tokens = decoder.tokens(CHECK_TOKENS)
    if tp.rank != 0:
        # Exactly rank 0's MPK launches (run_bench times them the same way), so that every
        # launch finds its peers.
        time_decode(decoder.step, job.new_tokens, warmup=WARMUP, repeats=REPEATS)
        return None
    result = run_bench(cfg, job.batch, job.new_tokens, job.source.seed, decoder.step,
                       weights=weights, prompt_len=PROMPT_LEN, check_tokens=CHECK_TOKENS)
    same = sum(a == b for a, b in zip(mpk_tokens, result["baseline_tokens"]))
    result.update(tp=tp.size, mpk_plan_s=round(decoder.plan_s, 2),
                  mpk_build_s=round(decoder.build_s, 2), mpk_tokens=mpk_tokens,
                  tokens_agree=f"{same}/{len(mpk_tokens)}")
    return result
