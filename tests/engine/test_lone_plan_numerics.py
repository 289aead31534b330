"""The serving engine's one-row plan for a lone request rounds every row as the max_batch plan
that shares its KV cache (Engine._rows_plan builds it with EngineConfig.decode_shape(1,
max_batch), whose DecodeShape.numerics_batch is max_batch), so a request's greedy tokens do not
depend on whether it ran alone or beside others (`mpk bench --serving`: outputs equal solo).

What sets the floating-point order of one row's results on the GPU, so what the two plans must
agree on:
  linear     the task count (a task's row groups -> its blocks of 8/4/2/1 row groups, the warps
             that meet a row group, the accumulator chain each unit goes to: geometry.py,
             sm90.cuh) and xc, the k per staged chunk (chunks are added in fp32 one after the
             other; the fused rmsnorm's sums of squares too): every linear param but the batch;
  attention  the KV split count (a split's positions, then the last split's sum over splits);
             not its query-head parts (a head's arithmetic is its own: tasks/attention).
Every other kind computes a row the same way in a plan of any batch: the batch only decides how
many rows a task takes or which task takes a row (rmsnorm: a row's sum in a fixed warp order;
moe_router / moe_gate_up / moe_down: a row's or pair's dot products in one warp, its slots in
order; argmax_reduce: the row's lm_head tiles, as many in both plans; embedding: a copy). The
linear kernel's two stagings (up to 8 rows, and 9-16) give every output the same products in
the same MMA slots and add the two MMAs' sums alike (sm90.cuh header); that the tensor cores
round an element the same in every row of the MMA is taken from the hardware, not tested here.

Whole plans cannot be compared on the CPU interpreter: its linears are torch matmuls, which
round a row of a [1, K] input differently from the same row of a [16, K] one. Its attention
can: with 4 KV splits and the merge one of this test's 16 rows differs from 1 split in a bf16
bit, so the attention test runs both plans' attention ops on the same rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mpk.backends.registry import create_executor
from mpk.compiler.fuse import fuse
from mpk.compiler.lower import compile_graph
from mpk.compiler.plan import Plan
from mpk.dtypes import DType
from mpk.engine import Engine, EngineConfig
from mpk.errors import GraphError, UnsupportedError
from mpk.graph.graph import Graph
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import get_preset
from mpk.models.rope import rope_table
from mpk.models.weights import random_weights
from mpk.tasks.base import OpView
from mpk.tasks.registry import get_kind
from mpk.tensors import Role

SEED = 20260315


def numerics(views: list[OpView]) -> dict[str, Any]:
    """Per op: what sets the order of its rows' sums (module doc); the other kinds by name."""
    out: dict[str, Any] = {}
    for view in views:
        if view.kind in ("linear", "attention"):
            params = dict(get_kind(view.kind).param_values(view))
            params.pop("batch", None)
            parts = params.pop("parts", 1)
            out[view.name] = (view.kind, params, view.grid if view.kind == "linear" else
                              (view.grid[0] // parts, view.grid[2]))
        else:
            out[view.name] = view.kind
    return out


def graph_views(graph: Graph) -> list[OpView]:
    """The op views a compile of `graph` gives its kinds (after fusion, as Plan.op_view)."""
    fused = fuse(graph)
    return [fused.view(op) for op in fused.ops]


def plan_views(plan: Plan) -> list[OpView]:
    return [plan.op_view(i) for i in range(len(plan.ops))]


def assert_same_numerics(lone: list[OpView], slots: list[OpView]) -> None:
    got, want = numerics(lone), numerics(slots)
    assert got.keys() == want.keys(), f"ops only in one plan: {sorted(got.keys() ^ want.keys())}"
    bad = [f"{name}: lone {got[name]} vs max_batch {want[name]}" for name in want
           if got[name] != want[name]]
    assert not bad, "\n".join(bad[:6])


@pytest.mark.parametrize(("model", "max_seq_len"), [
    ("qwen3-0.6b", 384),  # the serving bench's context: 2 KV splits at one row, 1 at 16
    ("qwen3-0.6b", 2048),  # the engine's default: 8 splits at one row
    ("qwen3-8b", 384),  # inputs staged in chunks at 16 rows (K 4096), lm_head 396 tasks
    ("llama-3.2-1b", 384),  # down's K 8192 in 3 chunks at 16 rows, 1 at one
    ("qwen3-30b-a3b", 384),  # MoE: the router gate and o_proj (K 4096)
    ("qwen3-30b-a3b", 256),  # one KV split: at one row attention's 8 query heads in 4 parts
])
def test_the_lone_plan_of_a_real_model_rounds_as_the_max_batch_plan(model: str,
                                                                    max_seq_len: int) -> None:
    cfg = get_preset(model)
    options = EngineConfig(num_sms=132, max_seq_len=max_seq_len)
    max_batch = 16
    lone = build_graph(cfg, options.decode_shape(1, max_batch), num_sms=options.num_sms)
    slots = build_graph(cfg, options.decode_shape(max_batch), num_sms=options.num_sms)
    assert_same_numerics(graph_views(lone), graph_views(slots))


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama", "tiny-qwen3-moe"])
def test_a_serving_engine_builds_its_lone_plan_to_round_as_its_slots(model: str) -> None:
    """The engine's own plans (CPU backend): 8 SMs and 1,024 positions give 4 KV splits at one
    row and 1 at four, unless the one-row plan follows the four-row plan."""
    cfg = get_preset(model)
    engine = Engine(cfg, random_weights(cfg, seed=SEED), backend="cpu", num_sms=8,
                    max_seq_len=1024, steps_per_launch=4, progress=False, prefill_chunk=0)
    engine.start(max_batch=4)
    try:
        runner = engine._runners[4]
        lone = runner.rows[1].plan
    finally:
        engine.stop()
    assert lone.tensor("positions").shape == (1,)
    assert_same_numerics(plan_views(lone), plan_views(runner.plan))


def attention_plan(graph: Graph, num_sms: int) -> Plan:
    """Layer 0's attention op of `graph` alone, its qkv an input."""
    ops = [op for op in graph.ops if op.name == "layers.0.attention"]
    sub = Graph()
    for name in sorted({t for op in ops for _, t in op.operands}):
        t = graph.tensors[name]
        sub.add_tensor(name, t.shape, t.dtype, Role.IO if name == "layers.0.qkv" else t.role)
    for op in ops:
        sub.add_op(op.kind, op.name, op.grid, dict(op.operands), dict(op.splits),
                   **dict(op.attrs))
    return compile_graph(sub, num_sms)


def test_a_row_of_the_lone_plans_attention_equals_its_row_in_the_max_batch_plan() -> None:
    """Each of 16 rows (contexts of 100-1,000 positions) through the lone plan's attention
    equals, bit for bit, its row of the 16-row plan's attention on the same cache."""
    cfg = get_preset("tiny-qwen3")
    options = EngineConfig(num_sms=8, max_seq_len=1024)
    rows = 16
    gen = torch.Generator().manual_seed(SEED)
    shape = options.decode_shape(rows)
    cache = (shape.num_pages, shape.page_size, cfg.num_kv_heads, cfg.head_dim)
    k_cache = torch.randn(cache, generator=gen).bfloat16()
    v_cache = torch.randn(cache, generator=gen).bfloat16()
    width = cfg.num_kv_heads * (cfg.group + 2) * cfg.head_dim
    inputs = {
        "layers.0.qkv": torch.randn(rows, width, generator=gen).bfloat16(),
        "page_table": torch.randperm(shape.num_pages, generator=gen).int().reshape(rows, -1),
        "positions": torch.randint(100, 1000, (rows,), generator=gen).int(),
        "runs": torch.zeros(rows, 2, dtype=torch.int32),
    }
    weights = {"layers.0.q_norm": torch.randn(cfg.head_dim, generator=gen).bfloat16(),
               "layers.0.k_norm": torch.randn(cfg.head_dim, generator=gen).bfloat16(),
               "rope": rope_table(cfg, shape.max_seq_len)}

    def attend(batch: int, first: int) -> torch.Tensor:
        graph = build_graph(cfg, options.decode_shape(batch, rows), num_sms=options.num_sms,
                            layers=range(1))
        ex = create_executor(attention_plan(graph, options.num_sms), "cpu")
        for name, t in weights.items():
            ex.bind(name, t)
        ex.bind("k_cache.0", k_cache.clone())
        ex.bind("v_cache.0", v_cache.clone())
        for name, t in inputs.items():
            ex.bind(name, t[first: first + batch].clone())
        ex.run(1)
        return ex.read("layers.0.attn")

    together = attend(rows, 0)
    differ = [b for b in range(rows) if not torch.equal(attend(1, b)[0], together[b])]
    assert not differ, f"rows {differ} of the lone plan differ from the max_batch plan's"


def test_a_plan_rounds_as_a_plan_of_at_least_its_rows() -> None:
    assert DecodeShape(batch=2).numerics_rows == 2
    assert DecodeShape(batch=2, numerics_batch=16).numerics_rows == 16
    for numerics_batch in (1, 17):  # fewer rows than the plan's, more than a plan can have
        with pytest.raises(UnsupportedError, match="numerics_batch"):
            DecodeShape(batch=2, numerics_batch=numerics_batch)
    options = EngineConfig()
    assert options.decode_shape(1, 8).numerics_rows == 8  # the one-row plan of 8 slots
    assert options.decode_shape(16, 8).numerics_rows == 16  # the prefill_rows plan: its own


@pytest.mark.parametrize(("batch", "xc", "ok"), [
    (1, 0, True), (1, 3072, True), (16, 3072, True), (16, 3328, False), (1, 48, False),
    (1, -32, False)])
def test_a_linears_input_chunk_is_whole_units_its_staging_holds(batch: int, xc: int,
                                                                ok: bool) -> None:
    """16 staged rows of 3,072 k (+ padding) fit the 104 KB of the widest staging, 3,328 do not;
    one row stages the 16-row plan's chunk (what the one-row plan of a server does)."""
    g = Graph()
    g.add_tensor("x", (batch, 4096), DType.BF16, Role.ACTIVATION)
    g.add_tensor("w", (64, 4096), DType.BF16, Role.WEIGHT)
    g.add_tensor("y", (batch, 64), DType.BF16, Role.ACTIVATION)

    def add() -> Any:
        return g.add_op("linear", "proj", (1,), {"x": "x", "weight": "w", "out": "y"}, xc=xc)

    if not ok:
        with pytest.raises(GraphError, match="input chunk"):
            add()
        return
    view = g.view(add())
    assert get_kind("linear").param_values(view)["xc"] == (xc or 4096)  # 0: one row's chunk
