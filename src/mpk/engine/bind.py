"""A model's tensors bound to an executor for a run outside the Engine (mpk check, mpk bench,
mpk profile, tests): weights, noise-filled KV caches and a shuffled page table. The Engine binds
its own KV pages instead."""

from __future__ import annotations

import torch

from mpk.backends.base import Executor
from mpk.compiler.plan import Plan
from mpk.models import decode_io as io
from mpk.models.builder import DecodeShape, graph_weights
from mpk.models.config import ModelConfig


def bind_model(ex: Executor, plan: Plan, cfg: ModelConfig, shape: DecodeShape,
               weights: dict[str, torch.Tensor], seed: int) -> None:
    """Bind weights, noise-filled KV caches and a shuffled page table (same for every seed)."""
    gen = torch.Generator().manual_seed(seed)
    names = {t.name for t in plan.tensors}
    for name, tensor in graph_weights(cfg, weights, shape.max_seq_len).items():
        if name in names:
            ex.bind(name, tensor)
    cache = (shape.num_pages, shape.page_size, cfg.num_kv_heads, cfg.head_dim)
    for layer in range(cfg.num_layers):
        for kv in ("k", "v"):
            ex.bind(f"{kv}_cache.{layer}", torch.randn(cache, generator=gen).bfloat16())
    pages = torch.randperm(shape.num_pages, generator=gen)[: shape.batch * shape.max_pages]
    ex.bind("page_table", pages.reshape(shape.batch, shape.max_pages).int())
    ex.bind("positions", torch.zeros(shape.batch, dtype=torch.int32))
    ex.bind("prompt", torch.full((shape.steps_per_launch, shape.batch), -1, dtype=torch.int32))
    ex.bind("tokens_out", torch.zeros((shape.steps_per_launch, shape.batch), dtype=torch.int32))
    if io.SAMPLING in names:  # greedy rows
        ex.bind(io.SAMPLING, torch.zeros((shape.batch, io.SAMPLING_WORDS), dtype=torch.int32))
    if io.RUNS in names:  # every row alone
        ex.bind(io.RUNS, torch.zeros((shape.batch, io.RUN_WORDS), dtype=torch.int32))
