"""Continuous batching over one compiled plan: B slots, each with its own request, position and
KV pages, advanced together one launch at a time.

Between launches the scheduler frees the slots of finished or cancelled requests (their pages go
back to the pool at once) and admits waiting requests, first come first served, as long as a slot
and the pages for the request's whole length are free (a request that could never fit is refused
when it is submitted). A launch then runs n steps for every slot: a slot at position p is forced
to its prompt tokens while p + s is inside the prompt (graph IO PROMPT) and produces its j-th
token at position len(prompt) - 1 + j. An empty slot runs on a page table of NO_PAGE entries: it
writes no KV and its tokens are dropped. A request's tokens depend only on its own prompt (and
seed), never on which slot it got or what runs beside it.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from mpk.backends.base import Executor
from mpk.engine.kv_cache import PagePool
from mpk.engine.requests import (FinishReason, InvalidRequestError, RequestHandle,
                                 SamplingParams, positions_needed)
from mpk.models import decode_io as io
from mpk.tasks import sampling

log = logging.getLogger(__name__)

Detokenize = Callable[[list[int]], str]


@dataclass
class _Running:
    handle: RequestHandle
    pages: list[int]
    pos: int = 0  # the position this slot processes at the next launch's step 0
    stop_ids: frozenset[int] = frozenset()
    finished: FinishReason | None = None
    sampling_words: tuple[int, ...] = (0,) * io.SAMPLING_WORDS

    @property
    def steps_left(self) -> int:
        return len(self.handle.prompt) - 1 + self.handle.params.max_tokens - self.pos


@dataclass
class LaunchStats:
    steps: int = 0
    launches: int = 0
    seconds: float = 0.0
    launch_times: list[tuple[float, float, int]] = field(default_factory=list)  # start, end, n


class Scheduler:
    """Runs requests on `executor` (a plan of `slots` rows) with pages from `pool`."""

    def __init__(self, executor: Executor, pool: PagePool, slots: int, max_pages: int,
                 steps_per_launch: int, eos_token_ids: Iterable[int] = (),
                 detokenize: Detokenize | None = None, sampling: bool = True) -> None:
        """`sampling`: the plan has the SAMPLING input (every model plan does; test doubles of
        an executor may not)."""
        self.executor, self.pool = executor, pool
        self.sampling = sampling
        self.slots, self.max_pages, self.steps_per_launch = slots, max_pages, steps_per_launch
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.detokenize = detokenize
        self.running: list[_Running | None] = [None] * slots
        self.waiting: collections.deque[RequestHandle] = collections.deque()
        self.stats = LaunchStats()
        self._lock = threading.Lock()

    # ---- requests ------------------------------------------------------------------------
    def submit(self, handle: RequestHandle) -> RequestHandle:
        need = self.pool.pages_for(positions_needed(len(handle.prompt), handle.params.max_tokens))
        if need > self.max_pages or need > self.pool.num_pages:
            raise InvalidRequestError(
                f"a prompt of {len(handle.prompt)} tokens with max_tokens="
                f"{handle.params.max_tokens} needs {need} KV pages of {self.pool.page_size}; "
                f"a request can hold at most {min(self.max_pages, self.pool.num_pages)}")
        if handle.params.stop and self.detokenize is None:
            raise InvalidRequestError("stop strings need a tokenizer (load a checkpoint that "
                                      "has one)")
        with self._lock:
            self.waiting.append(handle)
        return handle

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.waiting) or any(r is not None for r in self.running)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.running)

    # ---- one launch ----------------------------------------------------------------------
    def step(self) -> int:
        """Admit what fits, run one launch, hand out its tokens. Returns the steps run."""
        self._retire_cancelled()
        self._admit()
        active = [r for r in self.running if r is not None]
        if not active:
            return 0
        n = min(self.steps_per_launch, max(r.steps_left for r in active))
        self._write_inputs()
        start = time.perf_counter()
        self.executor.run(n)
        produced = self.executor.read(io.TOKENS_OUT)
        end = time.perf_counter()
        self.stats.steps += n
        self.stats.launches += 1
        self.stats.seconds += end - start
        self.stats.launch_times.append((start, end, n))
        for b, run in enumerate(self.running):
            if run is not None:
                self._collect(run, produced[:n, b].tolist(), end)
                run.pos += n
                if run.finished is not None:
                    self._release(b, run.finished)
        return n

    def cancel_all(self) -> None:
        """Mark every waiting and running request cancelled (retired at the next step)."""
        with self._lock:
            handles = list(self.waiting)
        handles += [r.handle for r in self.running if r is not None]
        for handle in handles:
            handle.cancel()

    def fail_all(self, error: str) -> None:
        """The engine cannot go on (a kernel error): end every request with the error."""
        with self._lock:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for handle in waiting:
            handle.finish(FinishReason.ERROR, error=error)
        for b, run in enumerate(self.running):
            if run is not None:
                self._release(b, FinishReason.ERROR, error)

    # ---- internals -----------------------------------------------------------------------
    def _retire_cancelled(self) -> None:
        with self._lock:
            keep = collections.deque()
            for handle in self.waiting:
                if handle.cancelled:
                    handle.finish(FinishReason.CANCELLED)
                else:
                    keep.append(handle)
            self.waiting = keep
        for b, run in enumerate(self.running):
            if run is not None and run.handle.cancelled:
                self._release(b, FinishReason.CANCELLED)

    def _admit(self) -> None:
        with self._lock:
            for b in range(self.slots):
                if self.running[b] is not None or not self.waiting:
                    continue
                handle = self.waiting[0]
                params = handle.params
                if params.max_tokens == 0:
                    self.waiting.popleft()
                    handle.finish(FinishReason.LENGTH, text="" if self.detokenize else None)
                    continue
                need = self.pool.pages_for(positions_needed(len(handle.prompt), params.max_tokens))
                if need > self.pool.num_free:
                    break  # first come first served: wait for pages to come back
                self.waiting.popleft()
                pages = self.pool.allocate(positions_needed(len(handle.prompt), params.max_tokens))
                handle.stats.admitted = time.perf_counter()
                stop_ids = frozenset(params.stop_token_ids) | self.eos
                self.running[b] = _Running(handle, pages, stop_ids=stop_ids,
                                           sampling_words=sampling_words(params))

    def _write_inputs(self) -> None:
        steps, slots = self.steps_per_launch, self.slots
        prompt = torch.full((steps, slots), io.NO_FORCE, dtype=torch.int32)
        positions = torch.zeros(slots, dtype=torch.int32)
        table = torch.full((slots, self.max_pages), io.NO_PAGE, dtype=torch.int32)
        words = torch.zeros((slots, io.SAMPLING_WORDS), dtype=torch.int32)
        for b, run in enumerate(self.running):
            if run is None:
                prompt[:, b] = 0  # an empty slot embeds token 0 (its tokens are dropped)
                continue
            positions[b] = run.pos
            words[b] = torch.tensor(run.sampling_words, dtype=torch.int32)
            chunk = run.handle.prompt[run.pos: run.pos + steps]
            if chunk:
                prompt[: len(chunk), b] = torch.tensor(chunk, dtype=torch.int32)
            table[b, : len(run.pages)] = torch.tensor(run.pages, dtype=torch.int32)
        self.executor.write(io.PROMPT, prompt)
        self.executor.write(io.POSITIONS, positions)
        self.executor.write(io.PAGE_TABLE, table)
        if self.sampling:
            self.executor.write(io.SAMPLING, words)

    def _collect(self, run: _Running, produced: list[int], now: float) -> None:
        handle, params = run.handle, run.handle.params
        first_out = len(handle.prompt) - 1  # the position whose step yields token 0
        for s, token in enumerate(produced):
            if run.finished is not None:
                return
            if run.pos + s < first_out:
                continue
            handle.deliver(int(token), now)
            if int(token) in run.stop_ids:
                run.finished = FinishReason.STOP
            elif params.stop and self._stop_string(handle):
                run.finished = FinishReason.STOP
            elif len(handle.tokens) >= params.max_tokens:
                run.finished = FinishReason.LENGTH

    def _stop_string(self, handle: RequestHandle) -> bool:
        assert self.detokenize is not None
        text = self.detokenize(handle.tokens)
        return any(s in text for s in handle.params.stop)

    def _release(self, b: int, reason: FinishReason, error: str | None = None) -> None:
        run = self.running[b]
        assert run is not None
        self.pool.free(run.pages)
        self.running[b] = None
        run.handle.finish(reason, text=self._text(run.handle), error=error)

    def _text(self, handle: RequestHandle) -> str | None:
        """The output text, cut before the first stop string (None without a detokenizer)."""
        if self.detokenize is None:
            return None
        text = self.detokenize(handle.tokens)
        cuts = [text.find(s) for s in handle.params.stop if s in text]
        return text[: min(cuts)] if cuts else text


def sampling_words(params: SamplingParams) -> tuple[int, ...]:
    """A request's row of the SAMPLING input (tasks/sampling.py owns the layout)."""
    if params.greedy:
        return sampling.encode(0.0, 0)
    seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)
    return sampling.encode(params.temperature, seed, params.top_k, params.top_p)
