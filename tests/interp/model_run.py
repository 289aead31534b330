"""Shared set-up for interpreter tests: a tiny model's Plan with random weights bound."""

from __future__ import annotations

from mpk.backends.registry import create_executor
from mpk.compiler.lower import compile_graph
from mpk.compiler.plan import Plan
from mpk.engine.kv_cache import PagePool
from mpk.engine.requests import RequestHandle, SamplingParams
from mpk.engine.scheduler import Scheduler
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import ModelConfig


def make_plan(cfg: ModelConfig, shape: DecodeShape, num_sms: int, fuse_ops: bool = True) -> Plan:
    return compile_graph(build_graph(cfg, shape, num_sms=num_sms), num_sms, fuse_ops=fuse_ops)


def run_prompts(ex, shape: DecodeShape, prompts: list[list[int]], new_tokens: int,
                eos: tuple[int, ...] = ()) -> list[list[int]]:
    """Greedy generation on `ex` through the engine's own scheduler (its page pool, page table
    and launches): each prompt's new tokens."""
    sched = Scheduler(ex, PagePool(shape.num_pages, shape.page_size), shape.batch,
                      shape.max_pages, shape.steps_per_launch)
    params = SamplingParams(max_tokens=new_tokens, stop_token_ids=eos)
    handles = [sched.submit(RequestHandle(list(p), params)) for p in prompts]
    while sched.has_work():
        sched.step()
    return [h.result().token_ids for h in handles]


def executor(plan: Plan, **opts):
    return create_executor(plan, "cpu", **opts)
