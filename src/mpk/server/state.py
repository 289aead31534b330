"""What the routes share: the engine, the model's text side, metrics, and the server's life
(serving, draining, broken) with the count of HTTP requests in flight."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from mpk.engine import Engine
from mpk.server.metrics import EngineLoad, Metrics
from mpk.server.text import TextCodec


@dataclass
class ServerState:
    engine: Engine
    codec: TextCodec
    model_name: str
    max_seq_len: int
    max_batch: int
    eos_token_ids: tuple[int, ...] = ()
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # SIGTERM received: /v1 requests get 503, running ones finish
    engine_error: str | None = None  # the engine stopped after a failed launch
    metrics: Metrics = field(init=False)
    in_flight: int = 0  # /v1 requests whose response has not been sent completely
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while in_flight == 0

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.load, self.max_batch)
        self.idle.set()

    def load(self) -> EngineLoad:
        sched = self.engine.scheduler
        if sched is None:  # stopped (after a drain)
            return EngineLoad()
        pool = sched.pool
        return EngineLoad(running=sched.num_running, waiting=len(sched.waiting),
                          pages_used=pool.num_pages - pool.num_free, pages_total=pool.num_pages)

    def request_started(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def request_ended(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()
