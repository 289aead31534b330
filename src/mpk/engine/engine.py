"""Engine: a model's weights plus one compiled decode Plan per batch size, and greedy generation.

The engine owns what lies outside the megakernel: request validation, KV-cache pages, the page
table, the host loop over launches (mpk.engine.scheduler) and stop rules. It talks to a backend
only through the Executor protocol, so the CPU interpreter and the CUDA megakernel run the same
loop.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from mpk.backends.base import Executor
from mpk.backends.registry import create_executor, get_backend
from mpk.compiler.cache import compile_cached
from mpk.compiler.plan import Plan
from mpk.dtypes import DType
from mpk.engine.kv_cache import KvCache, KvShape
from mpk.engine.requests import (GenerationResult, InvalidRequestError, RequestHandle,
                                 SamplingParams, positions_needed, validate_prompt)
from mpk.engine.scheduler import Detokenize, LaunchStats, Scheduler
from mpk.engine.serving import ServingLoop
from mpk.errors import MpkError
from mpk.graph.graph import DEFAULT_NUM_SMS, Graph
from mpk.models.builder import DecodeShape, build_graph, graph_weights
from mpk.models.config import ModelConfig
from mpk.models.prefill import (PrefillShape, build_prefill_graph, prefill_segments,
                                supports_prefill)
from mpk.parallel.tp import TensorParallel
from mpk.tasks.linear.task import MAX_BATCH

log = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN = 2048


@dataclass(frozen=True)
class EngineConfig:
    """How the engine compiles and runs a model (everything but the model itself)."""

    backend: str = "cpu"
    num_sms: int = DEFAULT_NUM_SMS
    page_size: int = 16
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    steps_per_launch: int = 16
    # Rows of the plan that feeds long prompts (chunked prefill) when the batch's own plan has
    # fewer: compiled on first use, on the same KV cache (1: never).
    prefill_rows: int = MAX_BATCH
    # Prompt positions per launch of the prefill plan (models/prefill.py), where the backend
    # runs one, for prompts longer than half of it; longer ones take several (0: no prefill plan,
    # prompts go in as runs). Larger chunks feed long prompts faster (2,048 tokens on qwen3-8b,
    # H100: 87 ms in one chunk of 2048, 90 ms in two of 1024; perf-log, thirty-first session)
    # and stall the decoding requests longer per chunk.
    prefill_chunk: int = 256

    def __post_init__(self) -> None:
        get_backend(self.backend)
        for name in ("num_sms", "page_size", "max_seq_len", "steps_per_launch", "prefill_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise MpkError(f"engine option {name} must be a positive integer, got {value!r}")
        chunk = self.prefill_chunk
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise MpkError(f"engine option prefill_chunk must be an integer >= 0, got {chunk!r}")
        if self.prefill_rows > MAX_BATCH:
            raise MpkError(f"engine option prefill_rows must be at most {MAX_BATCH} (the rows "
                           f"a plan can have), got {self.prefill_rows}")

    @property
    def max_pages(self) -> int:
        """Pages one row needs for max_seq_len positions (the page table's width)."""
        return -(-self.max_seq_len // self.page_size)

    def decode_shape(self, batch: int, pool_rows: int | None = None) -> DecodeShape:
        """The compile-time sizes for `batch` rows on a KV pool of `pool_rows` (default: batch)
        rows' pages: every row may fill its whole page table. A plan of fewer rows than the
        pool's (the serving engine's one-row plan) rounds every row as the pool's own plan
        (DecodeShape.numerics_batch), so a request's tokens do not depend on which of the two
        ran it; a plan of more rows (prefill_rows) rounds as itself: a larger batch's staged
        input may not fit a smaller one's chunks."""
        rows = pool_rows or batch
        return DecodeShape(batch=batch, steps_per_launch=self.steps_per_launch,
                           page_size=self.page_size, max_pages=self.max_pages,
                           num_pages=rows * self.max_pages,
                           numerics_batch=rows if rows > batch else None)


@dataclass
class _Runner:
    """Everything compiled and allocated for one batch size, and once asked for, on the same KV
    cache: `rows`, the decode plans of other row counts by rows (prefill_rows for long prompts,
    one row for a lone request when serving), `chunk`, the prefill plan's executor."""

    plan: Plan
    executor: Executor
    cache: KvCache
    rows: dict[int, Executor] = field(default_factory=dict)
    chunk: Executor | None = None


class Engine:
    """Greedy generation with one persistent megakernel (or its CPU interpreter).

    `hf_weights` are the model's weights under Hugging Face names (see mpk.models.weights). The
    engine prepares the graph's weights (fused / permuted layouts, the RoPE table) once, then
    compiles a Plan the first time it sees each batch size and keeps it.

    With `tp` (TensorParallel(rank, G), G > 1) the engine is ONE rank of a tensor-parallel
    model and must run in a process of a torch.distributed group of G (mpk.parallel.launch):
    it compiles that rank's Plan, keeps only its shard of the weights and KV heads, and every
    rank runs the same host loop (the sampled tokens are identical on every rank). On CUDA the
    all-reduce runs inside the megakernel over peer memory (never run on GPUs yet).
    """

    def __init__(self, cfg: ModelConfig, hf_weights: Mapping[str, torch.Tensor],
                 backend: str = "cpu", num_sms: int | None = None, page_size: int = 16,
                 max_seq_len: int | None = None, steps_per_launch: int = 16,
                 device: str | torch.device | None = None, progress: bool | None = None,
                 tp: TensorParallel | None = None, prefill_rows: int | None = None,
                 prefill_chunk: int = 256) -> None:
        if tp is not None and tp.size > 1:
            tp.check(cfg)
        self.tp = tp if tp is not None and tp.size > 1 else None
        if max_seq_len is None:
            max_seq_len = min(DEFAULT_MAX_SEQ_LEN, cfg.max_position)
        self.cfg = cfg
        if num_sms is None:
            num_sms = get_backend(backend).num_sms(device)
        self.options = EngineConfig(backend=backend, num_sms=num_sms,
                                    page_size=page_size, max_seq_len=max_seq_len,
                                    steps_per_launch=steps_per_launch,
                                    prefill_rows=MAX_BATCH if prefill_rows is None
                                    else prefill_rows, prefill_chunk=prefill_chunk)
        if max_seq_len > cfg.max_position:
            raise MpkError(f"max_seq_len {max_seq_len} exceeds the model's max_position "
                           f"{cfg.max_position}")
        self.device = check_backend(backend, device)
        # None: show progress bars only when stderr is a terminal.
        self.progress = sys.stderr.isatty() if progress is None else progress
        self._runners: dict[int, _Runner] = {}
        self._serving: ServingLoop | None = None
        start = time.perf_counter()
        # The RoPE table covers every position a full page table can reach.
        self._weights = _graph_weights(cfg, hf_weights, self.options.max_pages * page_size,
                                       self.device, self.tp)
        self._unreported_load_s = time.perf_counter() - start

    @property
    def max_seq_len(self) -> int:
        return self.options.max_seq_len

    # ---- serving: requests that come and go ----------------------------------------------
    def start(self, max_batch: int = 8, detokenize: Detokenize | None = None) -> None:
        """Serve submitted requests on a background thread, up to `max_batch` at once (one plan
        of max_batch rows, a one-row plan for a lone request, the prefill plan where the backend
        runs one, and the plan of prefill_rows rows when that is larger: all built here, so no
        request waits for a compile). `detokenize` (token ids -> text) enables stop strings."""
        if self._serving is not None:
            raise MpkError("the engine is already serving")
        timings = {"compile_s": 0.0, "load_s": 0.0}
        sched = self._scheduler(max_batch, timings, detokenize, serving=True)
        if self._lone_plan(max_batch):
            self._single(max_batch, timings)
        if self._chunked:
            self._chunk(max_batch, timings)
        if self.options.prefill_rows > max_batch:
            self._wide(max_batch, timings)
        self._serving = ServingLoop(sched)

    def submit(self, prompt: Sequence[int], params: SamplingParams | None = None) -> RequestHandle:
        """Queue one request (after start()); iterate the handle for its tokens."""
        if self._serving is None:
            raise MpkError("call start() before submit()")
        params = params or SamplingParams()
        row = validate_prompt(prompt, self.cfg.vocab_size)
        need = positions_needed(len(row), params.max_tokens)
        if need > self.options.max_seq_len:
            raise InvalidRequestError(
                f"a prompt of {len(row)} tokens with max_tokens={params.max_tokens} needs {need} "
                f"positions, more than max_seq_len={self.options.max_seq_len}")
        return self._serving.submit(RequestHandle(row, params))

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop serving: drain (finish what was submitted) or cancel it, then end the loop."""
        if self._serving is not None:
            self._serving.stop(drain, timeout)
            self._serving = None

    @property
    def scheduler(self) -> Scheduler | None:
        """The serving scheduler (slots, waiting queue, page pool), for metrics."""
        return self._serving.scheduler if self._serving is not None else None

    @property
    def plans(self) -> dict[int, Plan]:
        """The compiled plans, by batch size."""
        return {batch: runner.plan for batch, runner in self._runners.items()}

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 eos_token_ids: Iterable[int] = (), sampling: SamplingParams | None = None,
                 detokenize: Detokenize | None = None) -> GenerationResult:
        """Continue each prompt: up to max_new_tokens new ids per prompt, cut after the first
        EOS id (which is kept). Greedy unless `sampling` says otherwise (its temperature, top_k,
        top_p, seed and stop strings; stop strings need `detokenize`). All prompts run in one
        batch (a plan of len(prompts) rows); prompts of different lengths share it."""
        rows = self._validate(prompts, max_new_tokens)
        timings = {"compile_s": 0.0, "load_s": self._unreported_load_s}
        self._unreported_load_s = 0.0
        params = dataclasses.replace(sampling or SamplingParams(), max_tokens=max_new_tokens,
                                     stop_token_ids=tuple(int(t) for t in eos_token_ids))
        if max_new_tokens == 0:
            return GenerationResult([[] for _ in rows], {**timings, "prefill_s": 0.0,
                                                         "decode_s": 0.0, "ms_per_token": 0.0,
                                                         "steps": 0, "launches": 0,
                                                         "overlapped_launches": 0},
                                    ["" for _ in rows] if detokenize else None)
        if self._serving is not None:  # share the serving slots (and start()'s detokenizer)
            results = [h.result() for h in [self.submit(row, params) for row in rows]]
            texts = [r.text for r in results]
            return GenerationResult([r.token_ids for r in results], timings,
                                    None if None in texts else texts)
        sched = self._scheduler(len(rows), timings, detokenize)
        handles = [sched.submit(RequestHandle(row, params)) for row in rows]
        sched.close()  # the whole batch is in: launches may start early once rows finish
        # Progress in tokens generated (prompts are fed a varying number of positions a step).
        with tqdm(total=len(rows) * max_new_tokens, desc="generating", unit="token",
                  disable=not self.progress, leave=False) as bar:
            while sched.has_work():
                sched.step()
                bar.update(sum(len(h.tokens) for h in handles) - bar.n)
        timings.update(_split_timings(sched.stats, handles))
        results = [h.result() for h in handles]
        return GenerationResult([r.token_ids for r in results], timings,
                                [r.text or "" for r in results] if detokenize else None)

    def _validate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidRequestError("prompts must be a list of token-id lists")
        if not prompts:
            raise InvalidRequestError("no prompts given: pass at least one list of token ids")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
                max_new_tokens < 0:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 0, got "
                                      f"{max_new_tokens!r}")
        rows = [validate_prompt(p, self.cfg.vocab_size, b) for b, p in enumerate(prompts)]
        for b, row in enumerate(rows):
            need = positions_needed(len(row), max_new_tokens)
            if need > self.options.max_seq_len:
                raise InvalidRequestError(
                    f"prompt {b} has {len(row)} tokens; with max_new_tokens={max_new_tokens} it "
                    f"needs {need} positions, more than max_seq_len={self.options.max_seq_len}")
        return rows

    # ---- one compiled plan per batch size ----------------------------------------------------
    def _scheduler(self, batch: int, timings: dict[str, float], detokenize: Detokenize | None,
                   serving: bool = False) -> Scheduler:
        runner = self._runner(batch, timings)

        def chunk_plan() -> tuple[Executor, int]:
            return self._chunk(batch, timings), self.options.prefill_chunk

        def wide_plan() -> tuple[Executor, int]:
            return self._wide(batch, timings), self.options.prefill_rows

        def single_plan() -> tuple[Executor, int]:
            return self._single(batch, timings), 1

        # Long prompts go through the prefill plan where the backend runs one; shorter ones (and
        # all, without one) as runs, on the wider plan when the batch's spare rows are few.
        chunked, wider = self._chunked, self.options.prefill_rows > batch
        return Scheduler(runner.executor, runner.cache.pool, batch, self.options.max_pages,
                         self.options.steps_per_launch, detokenize=detokenize,
                         wide=wide_plan if wider else None,
                         chunk=chunk_plan if chunked else None,
                         chunk_size=self.options.prefill_chunk,
                         chunk_segments=self._segments(batch),
                         single=single_plan if serving and self._lone_plan(batch) else None)

    def _lone_plan(self, batch: int) -> bool:
        """Whether serving on `batch` slots runs a lone request on a one-row plan (its own copy
        of the dense weights' streams on the GPU; one GPU only). Not for generate(): its last
        prompt alone would wait for a compile to save a fraction of a millisecond a step."""
        return batch > 1 and self.tp is None

    @property
    def _chunked(self) -> bool:
        """Whether prompts are fed by the prefill plan (a backend that runs one, one GPU)."""
        return (self.options.prefill_chunk > 0 and self.tp is None
                and supports_prefill(self.cfg, self.options.backend))

    @property
    def prefill_chunk(self) -> int:
        """Prompt positions per prefill-plan launch, or 0 when this engine feeds prompts as
        runs of its decode batch (no prefill plan on its backend or model, or disabled)."""
        return self.options.prefill_chunk if self._chunked else 0

    def _segments(self, batch: int) -> int:
        """Prompts one prefill launch of the batch-`batch` runner packs."""
        return prefill_segments(self.options.backend, self.options.prefill_chunk, batch)

    def _chunk(self, batch: int, timings: dict[str, float]) -> Executor:
        """The prefill plan of the batch-`batch` runner, on its KV cache."""
        runner = self._runners[batch]
        if runner.chunk is None:
            opts = self.options
            shape = PrefillShape(chunk=opts.prefill_chunk, page_size=opts.page_size,
                                 max_pages=opts.max_pages, num_pages=batch * opts.max_pages,
                                 segments=self._segments(batch))
            plan = self._compile(lambda: build_prefill_graph(self.cfg, shape, opts.num_sms),
                                 f"{self.cfg.name or self.cfg.arch}'s prefill plan", timings)
            runner.chunk = self._bound_executor(plan, runner.cache, timings)
        return runner.chunk

    def _runner(self, batch: int, timings: dict[str, float]) -> _Runner:
        if batch not in self._runners:
            opts = self.options
            shape = opts.decode_shape(batch)
            plan = self._compile_decode(shape, timings)
            start = time.perf_counter()
            kv_heads = self.cfg.num_kv_heads // (self.tp.size if self.tp else 1)
            cache = KvCache(KvShape(self.cfg.num_layers, shape.num_pages, opts.page_size,
                                    kv_heads, self.cfg.head_dim), device=self.device)
            timings["load_s"] += time.perf_counter() - start
            self._runners[batch] = _Runner(plan, self._bound_executor(plan, cache, timings),
                                           cache)
        return self._runners[batch]

    def _wide(self, batch: int, timings: dict[str, float]) -> Executor:
        """The prefill_rows plan of the batch-`batch` runner, on its KV cache."""
        return self._rows_plan(batch, self.options.prefill_rows, timings)

    def _single(self, batch: int, timings: dict[str, float]) -> Executor:
        """The one-row plan of the batch-`batch` runner, on its KV cache."""
        return self._rows_plan(batch, 1, timings)

    def _rows_plan(self, batch: int, rows: int, timings: dict[str, float]) -> Executor:
        runner = self._runners[batch]
        if rows not in runner.rows:
            plan = self._compile_decode(self.options.decode_shape(rows, batch), timings)
            runner.rows[rows] = self._bound_executor(plan, runner.cache, timings)
        return runner.rows[rows]

    def _compile_decode(self, shape: DecodeShape, timings: dict[str, float]) -> Plan:
        opts = self.options
        return self._compile(lambda: build_graph(self.cfg, shape, num_sms=opts.num_sms,
                                                 tp=self.tp),
                             f"{self.cfg.name or self.cfg.arch} for batch {shape.batch}",
                             timings)

    def _compile(self, graph: Callable[[], Graph], label: str,
                 timings: dict[str, float]) -> Plan:
        """The plan of `graph()` (cached by content), its time added to compile_s."""
        with self._status(f"compiling {label}"):
            start = time.perf_counter()
            plan = compile_cached(graph(), num_sms=self.options.num_sms)
            timings["compile_s"] += time.perf_counter() - start
        log.info("compiled %s: %d tasks in %.2f s", label, plan.num_tasks, timings["compile_s"])
        return plan

    def _bound_executor(self, plan: Plan, cache: KvCache,
                        timings: dict[str, float]) -> Executor:
        """An executor of `plan` with the weights, `cache` and the IO buffers bound, its time
        added to load_s."""
        start = time.perf_counter()
        executor = self._executor(plan)
        _bind_all(plan, executor, self._weights, cache, self.device)
        timings["load_s"] += time.perf_counter() - start
        return executor

    def _executor(self, plan: Plan) -> Executor:
        # The CUDA executor runs on the engine's device; the interpreter always on the CPU.
        if self.tp is not None and self.options.backend == "cpu":
            from mpk.parallel.group import rank_executor

            return rank_executor(plan)
        return create_executor(plan, self.options.backend, device=self.device)

    @contextmanager
    def _status(self, message: str) -> Iterator[None]:
        """A spinner on stderr while a slow step runs (only when progress is shown)."""
        if not self.progress:
            yield
            return
        from rich.console import Console

        with Console(stderr=True).status(message):
            yield


def check_backend(backend: str, device: str | torch.device | None = None) -> torch.device:
    """The device `backend` runs on (default: its natural one), or a clear error."""
    return get_backend(backend).device(device)


def _graph_weights(cfg: ModelConfig, hf_weights: Mapping[str, torch.Tensor], max_seq_len: int,
                   device: torch.device, tp: TensorParallel | None
                   ) -> dict[str, torch.Tensor]:
    """The tensors the graph binds by name (fused / permuted weights, RoPE table) on `device`;
    with `tp`, only this rank's share."""
    out = graph_weights(cfg, dict(hf_weights), max_seq_len, tp=tp)
    return {name: t.to(device).contiguous() for name, t in out.items()}


def _bind_all(plan: Plan, executor: Executor, weights: Mapping[str, torch.Tensor],
              cache: KvCache, device: torch.device) -> None:
    """Bind every attached tensor of the plan: weights, KV caches and engine-owned IO buffers."""
    for t in plan.tensors:
        if t.role == "weight":
            if t.name not in weights:
                raise MpkError(f"the plan needs weight {t.name!r} {list(t.shape)}, which the "
                               f"model's weights do not provide")
            executor.bind(t.name, weights[t.name])
        elif t.role == "io":
            tensor = cache.tensors.get(t.name)
            if tensor is None:  # prompt, positions, page_table, tokens_out, ...
                tensor = torch.zeros(t.shape, dtype=DType(t.dtype).torch, device=device)
            executor.bind(t.name, tensor)



def _split_timings(stats: LaunchStats, handles: Sequence[RequestHandle]) -> dict[str, float]:
    """prefill_s: launch time until every request had its first token; decode_s: the rest;
    ms_per_token: decode time per decode step (every step yields one token per row)."""
    firsts = [h.stats.token_times[0] for h in handles if h.stats.token_times]
    first_done = max(firsts) if firsts else float("inf")
    prefill = decode = 0.0
    decode_steps = 0
    for start, end, n in stats.launch_times:
        if end <= first_done:
            prefill += end - start
        else:
            decode += end - start
            decode_steps += n
    per_step = decode / decode_steps if decode_steps else stats.seconds / max(stats.steps, 1)
    return {"prefill_s": prefill, "decode_s": decode, "ms_per_token": per_step * 1e3,
            "steps": stats.steps, "launches": stats.launches,
            "overlapped_launches": stats.overlapped}
