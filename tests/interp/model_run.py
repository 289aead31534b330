"""Shared set-up for interpreter tests: a tiny model's Plan with random weights bound."""

from __future__ import annotations

import torch

from mpk.backends.base import create_executor
from mpk.compiler.lower import compile_graph
from mpk.compiler.plan import Plan
from mpk.models.builder import DecodeShape, build_graph, graph_weights
from mpk.models.config import ModelConfig


def make_plan(cfg: ModelConfig, shape: DecodeShape, num_sms: int, fuse_ops: bool = True) -> Plan:
    return compile_graph(build_graph(cfg, shape, num_sms=num_sms), num_sms, fuse_ops=fuse_ops)


def bind_all(ex, cfg: ModelConfig, shape: DecodeShape, weights: dict, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in graph_weights(cfg, weights, shape.max_seq_len).items():
        if any(t.name == name for t in ex.plan.tensors):
            ex.bind(name, tensor)
    cache = (shape.num_pages, shape.page_size, cfg.num_kv_heads, cfg.head_dim)
    for layer in range(cfg.num_layers):
        for kv in ("k", "v"):
            # noise past the current length: reading it would change the result
            ex.bind(f"{kv}_cache.{layer}", torch.randn(cache, generator=gen).bfloat16())
    b = shape.batch
    pages = torch.randperm(shape.num_pages, generator=gen)[: b * shape.max_pages]
    ex.bind("page_table", pages.reshape(b, shape.max_pages).int())
    ex.bind("positions", torch.zeros(b, dtype=torch.int32))
    ex.bind("prompt", torch.full((shape.steps_per_launch, b), -1, dtype=torch.int32))
    ex.bind("tokens_out", torch.zeros((shape.steps_per_launch, b), dtype=torch.int32))


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
