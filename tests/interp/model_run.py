"""Shared set-up for interpreter tests: a tiny model's Plan with random weights bound."""

from __future__ import annotations

import torch

from mpk.backends.base import create_executor
from mpk.compiler.lower import compile_graph
from mpk.compiler.plan import Plan
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import ModelConfig


def make_plan(cfg: ModelConfig, shape: DecodeShape, num_sms: int, fuse_ops: bool = True) -> Plan:
    return compile_graph(build_graph(cfg, shape, num_sms=num_sms), num_sms, fuse_ops=fuse_ops)


def run_prompts(ex, shape: DecodeShape, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Token-by-token prompt processing then greedy decode, over several launches."""
    b, per = len(prompts), shape.steps_per_launch
    total = max(len(p) for p in prompts) - 1 + new_tokens
    produced, step = [], 0
    while step < total:
        n = min(per, total - step)
        forced = torch.full((per, b), -1, dtype=torch.int32)
        for row, p in enumerate(prompts):
            for s in range(n):
                if step + s < len(p):
                    forced[s, row] = p[step + s]
        ex.write("prompt", forced)
        ex.write("positions", torch.full((b,), step, dtype=torch.int32))
        ex.run(n)
        produced.append(ex.read("tokens_out")[:n])
        step += n
    toks = torch.cat(produced)
    return [toks[len(p) - 1: len(p) - 1 + new_tokens, row].tolist() for row, p in enumerate(prompts)]


def executor(plan: Plan, **opts):
    return create_executor(plan, "cpu", **opts)
