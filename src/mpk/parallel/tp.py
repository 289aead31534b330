"""TensorParallel: which slice of a model one rank of G owns, and how graph tensors are sharded.

Megatron-style sharding of a decoder layer over the G GPUs of one host:
  column parallel  qkv_weight [KVH*(group+2)*D, H]  -> KV heads [r*KVH/G, (r+1)*KVH/G) with
                   their query heads (the fused QKV is grouped per KV head, so this is one cut);
                   gate_up_weight [2, I, H]           -> intermediate columns [r*I/G, (r+1)*I/G)
  row parallel     o_weight [H, NH*D]                 -> the K columns of this rank's query heads
                   down_weight [H, I]                 -> the K columns of this rank's I slice
  per rank         k_cache.l / v_cache.l [P, S, KVH, D] -> this rank's KV heads
  replicated       embed, norms, q/k norms, rope, lm_head (every rank computes all logits)

A row-parallel linear writes a partial product; the `allreduce` task sums the G partials and
adds the residual once (tasks/allreduce). Everything here is keyed on the builder's graph names,
so the same rule shards weights (graph_weights), KV caches and per-rank reads/writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from mpk.errors import UnsupportedError
from mpk.models.config import ModelConfig

# Graph tensor name -> the dim a rank takes a contiguous 1/G slice of. Anything not listed is
# replicated (identical on every rank).
SHARD_DIMS: tuple[tuple[re.Pattern[str], int], ...] = (
    (re.compile(r"layers\.\d+\.qkv_weight"), 0),
    (re.compile(r"layers\.\d+\.o_weight"), 1),
    (re.compile(r"layers\.\d+\.gate_up_weight"), 1),
    (re.compile(r"layers\.\d+\.down_weight"), 1),
    (re.compile(r"[kv]_cache\.\d+"), 2),
)


def shard_dim(name: str) -> int | None:
    """The dim of graph tensor `name` that tensor parallelism cuts, None if replicated."""
    for pattern, dim in SHARD_DIMS:
        if pattern.fullmatch(name):
            return dim
    return None


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `size` tensor-parallel ranks (one GPU each, on one host)."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        for field in ("rank", "size"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UnsupportedError(f"tensor parallel {field} must be an int, got {value!r}")
        if self.size < 1:
            raise UnsupportedError(f"tensor parallel size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise UnsupportedError(f"tensor parallel rank {self.rank} is outside "
                                   f"[0, {self.size})")

    @staticmethod
    def all(size: int) -> list[TensorParallel]:
        """Every rank of a `size`-way split, in rank order."""
        return [TensorParallel(rank, size) for rank in range(size)]

    def check(self, cfg: ModelConfig) -> None:
        """UnsupportedError unless `size` splits the model into whole KV groups and columns."""
        who = cfg.name or cfg.arch
        for field in ("num_kv_heads", "num_heads", "intermediate_size"):
            value = getattr(cfg, field)
            if value % self.size:
                raise UnsupportedError(
                    f"tensor parallel size {self.size} does not divide {field}={value} of model "
                    f"{who!r}: each rank needs whole KV heads (with their query heads) and an "
                    f"equal share of the MLP; use a size dividing {cfg.num_kv_heads} "
                    f"(num_kv_heads) and {cfg.intermediate_size} (intermediate_size)")

    # ---- this rank's share ------------------------------------------------------------------
    def kv_heads(self, cfg: ModelConfig) -> range:
        n = cfg.num_kv_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def query_heads(self, cfg: ModelConfig) -> range:
        kv = self.kv_heads(cfg)
        return range(kv.start * cfg.group, kv.stop * cfg.group)

    def intermediate(self, cfg: ModelConfig) -> range:
        n = cfg.intermediate_size // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def local_kv_heads(self, cfg: ModelConfig) -> int:
        return cfg.num_kv_heads // self.size

    def local_intermediate(self, cfg: ModelConfig) -> int:
        return cfg.intermediate_size // self.size

    # ---- tensors -----------------------------------------------------------------------------
    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the FULL (single-rank) graph tensor `name` (a view)."""
        dim = shard_dim(name)
        if dim is None:
            return tensor
        full = tensor.shape[dim]
        if full % self.size:
            raise UnsupportedError(f"tensor {name!r} {list(tensor.shape)}: dim {dim} ({full}) is "
                                   f"not divisible by tensor parallel size {self.size}")
        n = full // self.size
        return tensor.narrow(dim, self.rank * n, n)

    def shard_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """graph_weights' output -> this rank's (contiguous, so a device copy is one slab)."""
        return {name: self.shard(name, t).contiguous() for name, t in weights.items()}


class RankView:
    """One rank's executor (in its own process) seen as an executor of the FULL model: bind and
    write take full tensors and keep this rank's shard; read and run pass through (reads of
    sharded tensors return the shard). Lets full-model helpers such as mpk.engine.bind.bind_model
    drive one rank."""

    def __init__(self, executor: Any, tp: TensorParallel) -> None:
        self.executor, self.tp = executor, tp
        self.plan = executor.plan

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        self.executor.bind(name, self.tp.shard(name, tensor).contiguous())

    def write(self, name: str, value: torch.Tensor) -> None:
        self.executor.write(name, self.tp.shard(name, value).contiguous())

    def read(self, name: str) -> torch.Tensor:
        return self.executor.read(name)

    def run(self, num_steps: int = 1) -> None:
        self.executor.run(num_steps)


def unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (replicated: rank 0's copy)."""
    dim = shard_dim(name)
    return parts[0] if dim is None else torch.cat(parts, dim=dim)
