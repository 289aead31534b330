"""MPK's side of the benchmark: compile a model for the CUDA backend, process the benchmark's
prompt, then decode in timed launches that rewind to the same position each time."""

from __future__ import annotations

import time

import torch

from mpk.backends.registry import create_executor, get_backend
from mpk.compiler.cache import compile_cached
from mpk.engine.bind import bind_model
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import ModelConfig
from mpk.parallel.tp import RankView, TensorParallel


def decode_shape(batch: int, prompt_len: int, new_tokens: int, page_size: int = 16
                 ) -> DecodeShape:
    """The plan shape MpkDecoder compiles: one launch holds the prompt or `new_tokens` steps,
    the pages hold the prompt, the new tokens and one more position."""
    pages = -(-(prompt_len + new_tokens + 1) // page_size)
    return DecodeShape(batch=batch, steps_per_launch=max(prompt_len, new_tokens),
                       page_size=page_size, max_pages=pages, num_pages=batch * pages)


class MpkDecoder:
    """`step(n)` runs n greedy decode steps in one launch starting at position len(prompt).

    With `tp` this is one rank of a tensor-parallel run (one process per GPU, every rank
    making the same calls): it compiles the rank's Plan and binds its shard of `weights`.
    backend="cpu" runs the same launches on the interpreter (tests)."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], prompt: torch.Tensor,
                 new_tokens: int, num_sms: int | None = None, page_size: int = 16,
                 tp: TensorParallel | None = None, backend: str = "cuda") -> None:
        batch, self.prompt_len = prompt.shape
        if num_sms is None:
            num_sms = get_backend(backend).num_sms()
        self.shape = decode_shape(batch, self.prompt_len, new_tokens, page_size)
        t0 = time.perf_counter()
        graph = build_graph(cfg, self.shape, num_sms=num_sms, tp=tp)
        self.plan = compile_cached(graph, num_sms)
        self.plan_s = time.perf_counter() - t0
        executor = create_executor(self.plan, backend)
        self.executor = executor if tp is None else RankView(executor, tp)
        self.build_s = time.perf_counter() - t0 - self.plan_s
        bind_model(self.executor, self.plan, cfg, self.shape, weights, seed=0)
        forced = torch.full((self.shape.steps_per_launch, batch), -1, dtype=torch.int32)
        forced[: self.prompt_len] = prompt.T.int().cpu()
        self.executor.write("prompt", forced)
        self.executor.run(self.prompt_len)
        # The prompt's last step already produced the first generated token; the baseline's
        # token list starts with it, so tokens() must too.
        self._first = int(self.executor.read("tokens_out")[self.prompt_len - 1, 0])
        self.executor.write("prompt", torch.full_like(forced, -1))
        self._start = torch.full((batch,), self.prompt_len, dtype=torch.int32)

    def step(self, n: int) -> None:
        self.executor.write("positions", self._start)
        self.executor.run(n)

    def tokens(self, n: int) -> list[int]:
        """Row 0's first n generated tokens, as DecodeLoop.generate(n) lists them: the one the
        prompt's last step produced, then n - 1 decode steps. Call it before any step(): a
        launch embeds the previous launch's last token at its first step."""
        if n <= 1:
            return [self._first][:n]
        self.step(n - 1)
        return [self._first] + self.executor.read("tokens_out")[:n - 1, 0].tolist()
