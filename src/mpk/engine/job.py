"""A generation job as plain data, so that one process or G tensor-parallel processes run it.

`mpk generate` describes what to run (GenerateJob: where the weights come from, the prompts,
the engine options) and calls `run_job(job, tp_size)`. With tp_size 1 the job runs in this
process; with G > 1 each of G spawned processes loads the model, keeps its rank's shard and runs
the same decode loop (mpk.parallel.launch), and rank 0's result comes back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mpk.backends.registry import get_backend
from mpk.engine.requests import GenerationResult, SamplingParams
from mpk.engine.engine import Engine
from mpk.models.config import ModelConfig
from mpk.models.weights import load_checkpoint, random_weights
from mpk.parallel.launch import run_ranks
from mpk.parallel.tp import TensorParallel


@dataclass(frozen=True)
class ModelSource:
    """A local checkpoint (a Hugging Face folder or a GGUF file), or a preset with seeded random
    weights."""

    cfg: ModelConfig
    checkpoint: str | None = None
    seed: int = 0

    def load(self, device: str) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face names, on `device`."""
        if self.checkpoint is None:
            return random_weights(self.cfg, self.seed, device)
        _, weights = load_checkpoint(self.checkpoint)
        return {name: t.to(device) for name, t in weights.items()}


@dataclass(frozen=True)
class GenerateJob:
    source: ModelSource
    prompts: Sequence[Sequence[int]]
    max_new_tokens: int
    eos_token_ids: Sequence[int] = ()
    backend: str = "cpu"
    num_sms: int | None = None
    max_seq_len: int | None = None
    steps_per_launch: int = 16
    prefill_rows: int | None = None  # the engine's prefill_rows plan (None: its default)
    prefill_chunk: int = 256  # positions per prefill-plan launch (0: none)
    progress: bool | None = None
    # Greedy by default; max_tokens and stop ids come from the fields above.
    sampling: SamplingParams = SamplingParams()
    # For stop strings: decodes ids to text (a tokenizers.Tokenizer pickles to the ranks).
    tokenizer: Any = None


def run_job(job: GenerateJob, tp_size: int = 1) -> GenerationResult:
    """Run `job` in this process (tp_size 1) or on tp_size tensor-parallel ranks (processes,
    through the parallel launcher); rank 0's result."""
    if tp_size == 1:
        return _run_engine(job, None, job.progress)
    TensorParallel(0, tp_size).check(job.source.cfg)  # before starting any process
    return run_ranks(tp_size, _run_rank, job, backend=job.backend)


def _run_rank(tp: TensorParallel, job: GenerateJob) -> GenerationResult:
    return _run_engine(job, tp, job.progress if tp.rank == 0 else False)


def _run_engine(job: GenerateJob, tp: TensorParallel | None,
                progress: bool | None) -> GenerationResult:
    weights = job.source.load(get_backend(job.backend).device_type)
    engine = Engine(job.source.cfg, weights, backend=job.backend, num_sms=job.num_sms,
                    max_seq_len=job.max_seq_len, steps_per_launch=job.steps_per_launch,
                    prefill_rows=job.prefill_rows, prefill_chunk=job.prefill_chunk,
                    progress=progress, tp=tp)
    detokenize = job.tokenizer.decode if job.tokenizer is not None else None
    return engine.generate(job.prompts, job.max_new_tokens, eos_token_ids=job.eos_token_ids,
                           sampling=job.sampling, detokenize=detokenize)
