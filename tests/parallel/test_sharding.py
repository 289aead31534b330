"""Tensor-parallel sharding: validation, per-rank shapes, and shards that reassemble exactly."""

from __future__ import annotations

import pytest
import torch

from mpk.errors import UnsupportedError
from mpk.models.builder import DecodeShape, build_graph, graph_weights
from mpk.models.config import get_preset
from mpk.models.weights import random_weights
from mpk.parallel import TensorParallel, shard_dim, unshard
from mpk.tensors import Role

SHAPE = DecodeShape(batch=2, steps_per_launch=4, page_size=4, max_pages=8, num_pages=16)


@pytest.mark.parametrize("size", [3, 4, 8])
def test_size_must_divide_heads_and_mlp(size: int) -> None:
    cfg = get_preset("tiny-llama")  # 4 heads, 2 KV heads, intermediate 160
    with pytest.raises(UnsupportedError, match="num_kv_heads"):
        build_graph(cfg, SHAPE, num_sms=6, tp=TensorParallel(0, size))
    with pytest.raises(UnsupportedError, match=f"size {size}"):
        graph_weights(cfg, random_weights(cfg, 0), 32, tp=TensorParallel(0, size))


def test_intermediate_size_is_checked_too() -> None:
    import dataclasses

    cfg = dataclasses.replace(get_preset("tiny-qwen3"), intermediate_size=129)
    with pytest.raises(UnsupportedError, match="intermediate_size=129"):
        TensorParallel(1, 2).check(cfg)


@pytest.mark.parametrize("rank, size", [(2, 2), (-1, 2), (0, 0), (0, True)])
def test_invalid_rank_or_size(rank, size) -> None:
    with pytest.raises(UnsupportedError):
        TensorParallel(rank, size)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_rank_graph_shapes(preset: str) -> None:
    cfg = get_preset(preset)
    tp = TensorParallel(1, 2)
    g = build_graph(cfg, SHAPE, num_sms=6, tp=tp)
    d, h, group = cfg.head_dim, cfg.hidden_size, cfg.group
    assert g.tensors["layers.0.qkv_weight"].shape == ((group + 2) * d, h)  # one KV head
    assert g.tensors["layers.0.o_weight"].shape == (h, group * d)
    assert g.tensors["layers.0.gate_up_weight"].shape == (2, cfg.intermediate_size // 2, h)
    assert g.tensors["layers.0.down_weight"].shape == (h, cfg.intermediate_size // 2)
    assert g.tensors["k_cache.1"].shape == (SHAPE.num_pages, SHAPE.page_size, 1, d)
    assert g.tensors["lm_head"].shape == (cfg.vocab_size, h)  # replicated
    reduces = [op for op in g.ops if op.kind == "allreduce"]
    assert [op.name for op in reduces] == [f"layers.{l}.{w}_allreduce" for l in range(2)
                                           for w in ("attn", "mlp")]
    for op in reduces:
        assert dict(op.attrs)["ranks"] == 2
        assert dict(op.operands)["out"] == dict(op.operands)["residual"] == "hidden"
    # The row-parallel linears write the f32 partial and no longer add the residual.
    o_proj = next(op for op in g.ops if op.name == "layers.0.o_proj")
    assert dict(o_proj.operands) == {"x": "layers.0.attn", "weight": "layers.0.o_weight",
                                     "out": "layers.0.attn_partial"}
    assert g.tensors["layers.0.attn_partial"].dtype.value == "f32"
    assert g.tensors["layers.0.attn_partial"].role is Role.ACTIVATION


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_shards_reassemble_to_the_full_weights(preset: str) -> None:
    cfg = get_preset(preset)
    hf = random_weights(cfg, 7)
    full = graph_weights(cfg, hf, 32)
    ranks = [graph_weights(cfg, hf, 32, tp=tp) for tp in TensorParallel.all(2)]
    g = build_graph(cfg, SHAPE, num_sms=6, tp=TensorParallel(0, 2))
    for name, tensor in full.items():
        parts = [r[name] for r in ranks]
        assert torch.equal(unshard(name, parts), tensor), name
        if shard_dim(name) is None:
            assert all(torch.equal(p, tensor) for p in parts), name
        assert all(p.is_contiguous() for p in parts), name
        assert tuple(parts[0].shape) == g.tensors[name].shape, name
    sharded = {n for n in full if shard_dim(n) is not None}
    assert sharded == {f"layers.{l}.{w}" for l in range(cfg.num_layers)
                       for w in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")}


def test_row_parallel_partials_sum_to_the_full_product() -> None:
    """Rank r's o_proj columns are exactly the query heads its QKV slice produces."""
    cfg = get_preset("tiny-llama")
    hf = random_weights(cfg, 3)
    full = graph_weights(cfg, hf, 32)
    x = torch.randn(2, cfg.num_kv_heads, cfg.group * cfg.head_dim)  # attention output layout
    want = x.reshape(2, -1) @ full["layers.0.o_weight"].float().T
    got = torch.zeros_like(want)
    for tp in TensorParallel.all(2):
        heads = tp.kv_heads(cfg)
        w = graph_weights(cfg, hf, 32, tp=tp)["layers.0.o_weight"].float()
        got += x[:, heads.start:heads.stop].reshape(2, -1) @ w.T
        assert list(tp.query_heads(cfg)) == list(range(2 * tp.rank, 2 * tp.rank + 2))
    assert torch.allclose(got, want, atol=1e-5)


def test_default_graph_is_unchanged() -> None:
    """tp=None must build the single-GPU graph: no partials, no allreduce, in-place residuals."""
    cfg = get_preset("tiny-qwen3")
    g = build_graph(cfg, SHAPE, num_sms=6)
    assert not any(op.kind == "allreduce" for op in g.ops)
    assert not any(name.endswith("_partial") for name in g.tensors)
    down = next(op for op in g.ops if op.name == "layers.1.down")
    assert dict(down.operands)["residual"] == dict(down.operands)["out"] == "hidden"


def test_rank_view_binds_each_rank_its_shard() -> None:
    """One rank per process (RankView) binds exactly what the one-process G-rank executor
    gives that rank."""
    from mpk.backends.cpu.interpreter import CpuExecutor
    from mpk.engine.bind import bind_model
    from mpk.parallel import RankView, rank_plans
    from mpk.testing import MultiRankCpuExecutor

    cfg = get_preset("tiny-llama")
    weights = random_weights(cfg, 3)
    plans = rank_plans(cfg, SHAPE, 2, num_sms=4)
    together = MultiRankCpuExecutor(plans)
    bind_model(together.as_executor(), plans[0], cfg, SHAPE, weights, 3)
    for tp in TensorParallel.all(2):
        alone = CpuExecutor(plans[tp.rank])
        bind_model(RankView(alone, tp), plans[tp.rank], cfg, SHAPE, weights, 3)
        for t in plans[tp.rank].tensors:
            if t.role != Role.ACTIVATION.value:
                assert torch.equal(alone.read(t.name), together.read(tp.rank, t.name)), t.name
