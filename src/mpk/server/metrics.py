"""Prometheus metrics of the server (GET /metrics), in a registry of their own so that several
apps in one process (tests) do not collide.

Load gauges are read from the engine's scheduler when scraped; latencies come from each
request's engine statistics when it finishes (the engine's clock: a token's time is the end of
the launch that produced it, so tokens of one launch have inter-token gaps of 0).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from mpk.engine.requests import RequestResult

TOKENS_PER_S_WINDOW_S = 10.0  # mpk_generation_tokens_per_second averages over this window
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0)
_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
                2.56, 5.12)


@dataclass(frozen=True)
class EngineLoad:
    running: int = 0
    waiting: int = 0
    pages_used: int = 0
    pages_total: int = 0


class Metrics:
    CONTENT_TYPE = CONTENT_TYPE_LATEST

    def __init__(self, load: Callable[[], EngineLoad], max_batch: int) -> None:
        self.registry = r = CollectorRegistry()
        self._load = load

        def gauge(name: str, doc: str, read: Callable[[EngineLoad], float]) -> None:
            Gauge(name, doc, registry=r).set_function(lambda: read(self._load()))

        gauge("mpk_requests_running", "Requests holding a batch slot.", lambda s: s.running)
        gauge("mpk_requests_waiting", "Requests queued for a slot or KV pages.",
              lambda s: s.waiting)
        gauge("mpk_kv_pages_used", "KV-cache pages held by running requests.",
              lambda s: s.pages_used)
        gauge("mpk_kv_pages_total", "KV-cache pages in the pool.", lambda s: s.pages_total)
        Gauge("mpk_batch_slots", "Requests the engine decodes at once (--max-batch).",
              registry=r).set(max_batch)
        self.ttft = Histogram("mpk_time_to_first_token_seconds",
                              "From submission to the first token.", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.inter_token = Histogram("mpk_inter_token_latency_seconds",
                                     "Gaps between a request's consecutive tokens.",
                                     buckets=_GAP_BUCKETS, registry=r)
        self.queue_time = Histogram("mpk_queue_time_seconds",
                                    "From submission to admission (a slot and KV pages).",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("mpk_request_duration_seconds",
                                  "From submission to the last token.", buckets=_LATENCY_BUCKETS,
                                  registry=r)
        self.finished = Counter("mpk_requests", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("mpk_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.generation_tokens = Counter("mpk_generation_tokens", "Tokens generated.",
                                         registry=r)
        Gauge("mpk_generation_tokens_per_second",
              f"Tokens generated per second over the last {TOKENS_PER_S_WINDOW_S:g} s.",
              registry=r).set_function(self._tokens_per_s)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def tokens_generated(self, n: int = 1) -> None:
        self.generation_tokens.inc(n)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, n))
            self._trim(now)

    def request_finished(self, result: RequestResult, prompt_tokens: int) -> None:
        stats = result.stats
        self.finished.labels(result.finish_reason.value).inc()
        self.prompt_tokens.inc(prompt_tokens)
        if stats.ttft_s is not None:
            self.ttft.observe(stats.ttft_s)
            self.duration.observe(stats.token_times[-1] - stats.submitted)
        for gap in stats.inter_token_s:
            self.inter_token.observe(gap)
        if stats.admitted is not None:
            self.queue_time.observe(stats.admitted - stats.submitted)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _tokens_per_s(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            return sum(n for _, n in self._recent) / TOKENS_PER_S_WINDOW_S

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - TOKENS_PER_S_WINDOW_S:
            self._recent.popleft()
