"""Continuous batching over one compiled plan of B rows, with chunked prefill in the batch.

Up to B requests run at once, each with its own position and KV pages. Between launches the
scheduler frees the pages of finished or cancelled requests at once and admits waiting requests,
first come first served, as long as a row and the pages for the request's whole length are free
(a request that could never fit is refused when it is submitted). Then it lays the launch out:
every running request gets one row; rows left over go, oldest first, to requests that still have
several prompt tokens to feed, as a run (tasks/runs.py): w rows that take w consecutive prompt
positions per step, so a long prompt is fed up to B tokens a step beside the decoding rows (a
run is cut to what fills the launch's steps). When the spare rows cannot feed every prompt
within the launch and the engine has a wider plan on the same KV cache and page pool (its
prefill plan, EngineConfig.prefill_rows), the launch runs there instead, with the same layout
rules over its rows; when a single request is running and its prompt is fed, the launch runs on
the serving engine's one-row plan on the same cache (a 16-row step costs ~1.7x a one-row step
on the H200). With a prefill plan (EngineConfig.prefill_chunk = C), a request with more than
C / 2 of its prompt left (and more than a launch's steps) is fed C positions a launch there
instead, alternating with the other requests' launches, and is left out of theirs meanwhile.
A row alone is forced to its prompt token while inside the prompt and
embeds its own previous token after it; a request's first row in a launch is forced to its last
token, so a request may change rows between launches. A request's j-th token comes from the
step at its position len(prompt) - 1 + j. An unused row runs on a page table of NO_PAGE
entries: it writes no KV and its tokens are dropped. A request's tokens depend only on its own
prompt (and seed) up to rounding: which plan and rows feed a position depends on what runs
beside it, and plans may round differently (the interpreter's matmuls by row count, the two
attention kinds, a wider plan's KV splits and linear chunks), so at a real near-tie a greedy
token may flip. On the GPU the one-row plan rounds every row as the slots' plan
(EngineConfig.decode_shape: DecodeShape.numerics_batch), so decoding alone or beside others
gives the same tokens.

While every slot holds a request that decodes alone past its prompt, the next launch is started
before the last one's tokens are read (the executor's `start`: on the GPU the host then writes
its inputs and hands out tokens while the device runs): each row embeds its own last sample
(NO_FORCE), so its inputs do not depend on those tokens. A request a stop id ends in the last
launch then has one more launch of its row's tokens dropped; a request that arrives while a slot
is free is never made to wait for such an early launch, since none starts then (but after
close(): a batch given at once, where none can arrive).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from mpk.backends.base import Executor, Launch, overlaps, start
from mpk.engine.kv_cache import PagePool
from mpk.engine.layout import (InputShape, Rows, Running, advance, followers, lay_out,
                               sampling_words, write_inputs)
from mpk.engine.requests import (FinishReason, InvalidRequestError, RequestHandle,
                                 positions_needed)
from mpk.models import decode_io as io
from mpk.models.prefill import QUERY_BLOCK

log = logging.getLogger(__name__)

Detokenize = Callable[[list[int]], str]
# A plan of more rows than the slots that shares their KV cache and page pool, built on first
# use: (its executor, its rows).
WidePlan = Callable[[], tuple[Executor, int]]
# A prefill plan (models/prefill.py) on the same KV cache, built on first use: (its executor, its
# chunk of C prompt positions per launch).
ChunkPlan = Callable[[], tuple[Executor, int]]


@dataclass(frozen=True)
class _Decode:
    """A decode launch started and not yet handed out."""

    executor: Executor
    layout: list[Rows]
    steps: int
    launch: Launch
    started: float  # perf_counter() when it was started


@dataclass
class LaunchStats:
    steps: int = 0
    launches: int = 0
    overlapped: int = 0  # decode launches started before the launch ahead handed out its tokens
    seconds: float = 0.0
    # (start, end, n) a launch: end when its tokens came back; start when it was started, or
    # when the launch before it ended if it was started earlier (it ran after that one).
    launch_times: list[tuple[float, float, int]] = field(default_factory=list)
    prefill_pieces: list[int] = field(default_factory=list)  # prompts of each prefill launch
    decode_rows: list[int] = field(default_factory=list)  # the plan's rows, each decode launch


class Scheduler:
    """Runs requests on `executor` (a plan of `slots` rows) with pages from `pool`."""

    def __init__(self, executor: Executor, pool: PagePool, slots: int, max_pages: int,
                 steps_per_launch: int, eos_token_ids: Iterable[int] = (),
                 detokenize: Detokenize | None = None, sampling: bool = True,
                 runs: bool = True, wide: WidePlan | None = None,
                 chunk: ChunkPlan | None = None, chunk_size: int = 0,
                 chunk_segments: int = 1, single: WidePlan | None = None) -> None:
        """`sampling`, `runs`: the plan has the SAMPLING / RUNS input (every model plan does;
        test doubles of an executor may not). Without RUNS every request holds one row.
        `wide`: a plan of more rows on the same KV cache; a launch in which some prompt would
        not be fed within its steps runs there, its extra rows feeding prompts. `chunk`: a
        prefill plan on the same KV cache, of `chunk_size` (C) positions: a prompt longer than
        C / 2 is then fed C positions a launch there, alternating with the launches of the
        other requests. `chunk_segments`: prompts that plan's launch may hold (S > 1: pieces of
        several prompts share a launch, each from a 64-row block; models/prefill.py).
        `single`: a plan of one row on the same KV cache, for the launches of a lone request
        past its prompt."""
        self.executor, self.pool = executor, pool
        self.sampling, self.runs = sampling, runs
        self._wide_plan = wide if runs else None
        self._wide: tuple[Executor, int] | None = None
        self._single_plan = single
        self._single: tuple[Executor, int] | None = None
        if chunk is not None and chunk_size <= 0:
            raise ValueError("a prefill plan needs its chunk_size (positions per launch)")
        self._chunk_plan, self._chunk_size = chunk, chunk_size
        self._segments = chunk_segments
        self._chunk: tuple[Executor, int] | None = None
        self._last_was_chunk = False
        self.slots, self.max_pages, self.steps_per_launch = slots, max_pages, steps_per_launch
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.detokenize = detokenize
        self.running: list[Running] = []  # in admission order, at most `slots`
        self.waiting: collections.deque[RequestHandle] = collections.deque()
        self.stats = LaunchStats()
        self._in_flight: _Decode | None = None  # a decode launch whose tokens are not out yet
        self._last_end = 0.0  # when the last launch's tokens came back
        self._closed = False  # close(): no more submissions
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
            if self._closed:
                raise InvalidRequestError("this scheduler was closed to new requests")
            self.waiting.append(handle)
        return handle

    def close(self) -> None:
        """No request will be submitted any more (a batch given all at once, as
        Engine.generate's): launches may then start early with a slot free, since no newcomer
        could be kept waiting by one."""
        with self._lock:
            self._closed = True

    def has_work(self) -> bool:
        with self._lock:
            return bool(self.waiting) or bool(self.running) or self._in_flight is not None

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one launch ----------------------------------------------------------------------
    def step(self) -> int:
        """Hand out one launch's tokens: the decode launch in flight, else one run now (after
        admitting what fits). While every slot holds a request that decodes alone, the launch
        after it is started first (_start_next): its inputs do not depend on this launch's
        tokens, so the host's work between launches (handing out tokens, laying out and writing
        the next inputs) hides under the device's. Returns the steps handed out."""
        if self._in_flight is None:
            self._retire_cancelled()
            self._admit()
            if not self.running:
                return 0
            pieces = self._chunk_pieces()
            self._last_was_chunk = bool(pieces)
            if pieces:
                return self._chunk_launch(pieces)
            self._in_flight = self._start_decode()
        current = self._in_flight
        self._in_flight = self._start_next(current)
        return self._finish(current)

    def cancel_all(self) -> None:
        """Mark every waiting and running request cancelled (retired at the next step)."""
        with self._lock:  # the serving thread removes finished requests under the lock
            handles = list(self.waiting) + [r.handle for r in self.running]
        for handle in handles:
            handle.cancel()

    def fail_all(self, error: str) -> None:
        """The engine cannot go on (a kernel error): end every request with the error."""
        self._in_flight = None  # on a failed executor: nothing more comes back
        with self._lock:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for handle in waiting:
            handle.finish(FinishReason.ERROR, error=error)
        for run in list(self.running):
            self._release(run, FinishReason.ERROR, error)

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
        for run in list(self.running):
            if run.handle.cancelled:
                self._release(run, FinishReason.CANCELLED)

    def _admit(self) -> None:
        with self._lock:
            while self.waiting and len(self.running) < self.slots:
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
                self.running.append(Running(handle, pages, stop_ids=stop_ids,
                                             sampling_words=sampling_words(params)))

    def _chunked(self, run: Running) -> bool:
        """Whether `run`'s prompt goes on through the prefill plan. With one prompt a launch:
        while more of it is left than half a chunk (a chunk launch costs the same however few of
        its rows are prompt) and than one launch's steps; when a launch packs several prompts,
        while more is left than one launch's steps. The rule depends on the request alone, and
        so do its pieces (C positions, then the rest), so its prompt is cut into the same chunks
        whatever else runs (its tokens equal its solo run's: the chunk and the decode launches
        round differently). The tail goes as runs, whose width does depend on the neighbours;
        on the GPU a row's arithmetic is the same in a run of any width of one plan, on the
        interpreter only up to rounding."""
        if self._chunk_plan is None:
            return False
        least = self._chunk_size // 2 if self._segments == 1 else 0
        return run.prompt_left > max(self.steps_per_launch, least)

    def _decoding(self) -> list[Running]:
        """The running requests a decode launch takes (every one, but those being chunked)."""
        return [run for run in self.running if not self._chunked(run)]

    def _chunk_pieces(self) -> list[tuple[Running, int, int]]:
        """(request, first row, positions) of the prompt pieces the next launch of the prefill
        plan takes, when it is the prefill's turn (after a chunk, the others get a launch): the
        oldest requests' next pieces, each from a 64-row block, as many as fit."""
        needy = [r for r in self.running if self._chunked(r)]
        if not needy or (self._last_was_chunk and len(needy) < len(self.running)):
            return []
        pieces, row = [], 0
        for run in needy:
            m = min(self._chunk_size, run.prompt_left)
            if len(pieces) == self._segments or row + m > self._chunk_size:
                break
            pieces.append((run, row, m))
            row = -(-(row + m) // QUERY_BLOCK) * QUERY_BLOCK
        return pieces

    def _chunk_launch(self, pieces: list[tuple[Running, int, int]]) -> int:
        """Feed each piece's prompt positions in one launch of the prefill plan."""
        if self._chunk is None:
            self._chunk = self._chunk_plan()
        executor, c = self._chunk
        s = self._segments
        prompt = torch.zeros((1, c), dtype=torch.int32)
        table = torch.full((s, self.max_pages), io.NO_PAGE, dtype=torch.int32)
        words = torch.zeros((s, io.SAMPLING_WORDS), dtype=torch.int32)
        positions, lengths, starts, heads = [0] * s, [0] * s, [0] * s, [0] * s
        for k, (run, row, m) in enumerate(pieces):
            prompt[0, row: row + m] = torch.tensor(run.handle.prompt[run.pos: run.pos + m],
                                                   dtype=torch.int32)
            table[k, : len(run.pages)] = torch.tensor(run.pages, dtype=torch.int32)
            words[k] = torch.tensor(run.sampling_words, dtype=torch.int32)
            positions[k], lengths[k], starts[k], heads[k] = run.pos, m, row, run.pos + m - 1
        executor.write(io.PROMPT, prompt)
        executor.write(io.POSITIONS, torch.tensor(positions, dtype=torch.int32))
        executor.write(io.CHUNK, torch.tensor(lengths, dtype=torch.int32))
        executor.write(io.HEAD_POSITION, torch.tensor(heads, dtype=torch.int32))
        executor.write(io.PAGE_TABLE, table)
        executor.write(io.SAMPLING, words)
        if s > 1:
            executor.write(io.STARTS, torch.tensor(starts, dtype=torch.int32))
        began = time.perf_counter()
        produced = start(executor, 1, (io.TOKENS_OUT,)).wait()[io.TOKENS_OUT].tolist()
        end = self._last_end = time.perf_counter()
        self.stats.steps += 1
        self.stats.launches += 1
        self.stats.seconds += end - began
        self.stats.launch_times.append((began, end, 1))
        self.stats.prefill_pieces.append(len(pieces))
        for k, (run, _, m) in enumerate(pieces):
            if m == run.prompt_left:  # the piece ends the prompt: its token is the first output
                self._deliver(run, [produced[0][k]], end)
            run.pos += m
        for run, _, _ in pieces:
            if run.finished is not None:
                self._release(run, run.finished)
        return 1

    def _plan_decode(self) -> tuple[int, Executor, int, list[Rows]]:
        """The next decode launch of every request not being chunked: (steps, executor, its
        plan's rows, layout)."""
        n = min(self.steps_per_launch, max(r.steps_left for r in self._decoding()))
        executor, rows = self._plan_for(n)
        layout = self._layout(n, rows)
        # A run stops being useful once its prompt is fed: no longer launch than the rows need.
        n = min(n, max(-(-r.run.prompt_left // r.width) if r.is_run else r.run.steps_left
                       for r in layout))
        return n, executor, rows, layout

    def _start_decode(self, after: _Decode | None = None,
                      planned: tuple[int, Executor, int, list[Rows]] | None = None) -> _Decode:
        """Start the next decode launch (`planned` by _plan_decode, else planned here).
        `after`: the launch still running before it (_start_next)."""
        n, executor, rows, layout = planned or self._plan_decode()
        follows = set() if after is None else followers(after.layout, layout)
        write_inputs(executor, layout, InputShape(rows, self.steps_per_launch, self.max_pages,
                                                  self.sampling, self.runs), follows)
        started = time.perf_counter()
        launch = start(executor, n, (io.TOKENS_OUT,))
        self.stats.decode_rows.append(rows)
        for r in layout:
            advance(r, n)
        return _Decode(executor, layout, n, launch, started)

    def _start_next(self, current: _Decode) -> _Decode | None:
        """The decode launch after `current`, started before current's tokens come back, when
        every slot is taken and that launch's inputs do not depend on the tokens: every request
        of current goes on in the same single row of the same plan, past its prompt (it embeds
        its own last sample there), with steps left. A stop id found in current's tokens ends a
        request later (its row's extra steps are dropped). Else None: the next step lays the
        launch out once current's tokens are out. Only with every slot taken (or the scheduler
        closed and nobody waiting), because no request could join the early launch: one that
        arrives while a slot is free joins the next launch, not the one after it. Only on an
        executor that overlaps (base.overlaps): any other would run the early launch before
        handing out this one's tokens."""
        old = [r.run for r in current.layout]
        with self._lock:
            full = len(self.running) == self.slots or (self._closed and not self.waiting)
        if (not overlaps(current.executor) or not full or len(old) != len(self.running)
                or any(r.is_run for r in current.layout)
                or any(r.finished is not None or r.handle.cancelled or r.steps_left < 1
                       for r in old)):
            return None
        planned = self._plan_decode()
        if (planned[1] is not current.executor
                or len(followers(current.layout, planned[3])) != len(old)):
            return None
        self.stats.overlapped += 1
        return self._start_decode(after=current, planned=planned)

    def _finish(self, current: _Decode) -> int:
        """Wait for `current`, hand out its tokens, release the requests it finished."""
        produced = current.launch.wait()[io.TOKENS_OUT].tolist()  # indexed once per token
        end = time.perf_counter()
        begin = max(current.started, self._last_end)
        self._last_end = end
        n = current.steps
        self.stats.steps += n
        self.stats.launches += 1
        self.stats.seconds += end - begin
        self.stats.launch_times.append((begin, end, n))
        for rows in current.layout:
            self._collect(rows, produced, n, end)
        for run in list(self.running):
            if run.finished is not None:
                self._release(run, run.finished)
        return n

    def _plan_for(self, n: int) -> tuple[Executor, int]:
        """The executor of this launch and its rows: the wide plan when a prompt would not be
        fed within n steps on the slots' spare rows; the one-row plan for a lone request whose
        prompt is fed (but its last position); else the slots' own plan."""
        decoding = self._decoding()
        if self._single_plan is not None and len(decoding) == 1 and decoding[0].prompt_left <= 1:
            if self._single is None:
                self._single = self._single_plan()
            return self._single
        if self._wide_plan is not None:
            spare = self.slots - len(decoding)
            needs = sum(-(-r.prompt_left // n) - 1 for r in decoding if r.prompt_left > n)
            if needs > spare:
                if self._wide is None:
                    self._wide = self._wide_plan()
                if self._wide[1] > self.slots:
                    return self._wide
        return self.executor, self.slots

    def _layout(self, n: int, rows: int) -> list[Rows]:
        """The decoding requests (all but those the prefill plan feeds) laid out on `rows`."""
        return lay_out(self._decoding(), n, rows, self.runs)

    def _collect(self, rows: Rows, produced: list[list[int]], n: int, now: float) -> None:
        run = rows.run
        last = len(run.handle.prompt) - 1  # the position whose step yields token 0
        if rows.is_run:  # only the last prompt position's token counts
            if last < rows.pos + n * rows.width:
                s, i = divmod(last - rows.pos, rows.width)
                self._deliver(run, [produced[s][rows.first + i]], now)
            return
        first = max(0, last - rows.pos)
        self._deliver(run, [produced[s][rows.first] for s in range(first, n)], now)

    def _deliver(self, run: Running, tokens: list[int], now: float) -> None:
        """Hand the request this launch's `tokens` in order, up to the one that finishes it
        (a stop id or string, or max_tokens): the later ones are dropped."""
        if run.finished is not None or run.handle.cancelled:  # a launch in flight at a cancel
            return
        handle, params = run.handle, run.handle.params
        kept, room = 0, params.max_tokens - handle.num_tokens
        for token in tokens:
            kept += 1
            if token in run.stop_ids:
                run.finished = FinishReason.STOP
            elif params.stop and self._stop_string(handle.tokens + tokens[:kept], params.stop):
                run.finished = FinishReason.STOP
            elif kept >= room:
                run.finished = FinishReason.LENGTH
            if run.finished is not None:
                break
        handle.deliver(tokens[:kept], now)

    def _stop_string(self, tokens: list[int], stops: Sequence[str]) -> bool:
        assert self.detokenize is not None
        text = self.detokenize(tokens)
        return any(s in text for s in stops)

    def _release(self, run: Running, reason: FinishReason, error: str | None = None) -> None:
        self.pool.free(run.pages)
        with self._lock:
            self.running.remove(run)
        run.handle.finish(reason, text=self._text(run.handle), error=error)

    def _text(self, handle: RequestHandle) -> str | None:
        """The output text, cut before the first stop string (None without a detokenizer)."""
        if self.detokenize is None:
            return None
        text = self.detokenize(handle.tokens)
        cuts = [text.find(s) for s in handle.params.stop if s in text]
        return text[: min(cuts)] if cuts else text
