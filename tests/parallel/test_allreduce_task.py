"""The allreduce task kind on its own: rank-order sum, one rounding, the residual once, and
the CUDA backend's refusal (no sm90.cuh yet)."""

from __future__ import annotations

import pytest
import torch

from mpk.backends.registry import create_executor
from mpk.backends.cuda import codegen
from mpk.compiler.lower import compile_graph
from mpk.dtypes import DType
from mpk.errors import GraphError, MpkError
from mpk.graph.graph import Graph
from mpk.tasks.base import Tile
from mpk.tasks.registry import get_kind
from mpk.tensors import Role
from mpk.testing import MultiRankCpuExecutor

B, H, TILES = 2, 64, 4


def _graph(ranks: int, partial_dtype: DType = DType.F32) -> Graph:
    g = Graph()
    g.add_tensor("p", (B, H), partial_dtype, Role.IO)
    g.add_tensor("res", (B, H), DType.BF16, Role.IO)
    g.add_tensor("out", (B, H), DType.BF16, Role.IO)
    g.add_op("allreduce", "reduce", (TILES,), {"partial": "p", "residual": "res", "out": "out"},
             ranks=ranks)
    return g


def test_sum_in_rank_order_rounded_once_plus_residual() -> None:
    plans = [compile_graph(_graph(3), 2) for _ in range(3)]
    ex = MultiRankCpuExecutor(plans, order="random", seed=0)
    parts = [torch.randn(B, H) for _ in range(3)]
    res = torch.randn(B, H).bfloat16()
    for r in range(3):
        ex.bind(r, "p", parts[r])
        ex.bind(r, "res", res.clone())
        ex.bind(r, "out", torch.zeros(B, H, dtype=torch.bfloat16))
    ex.run(1)
    total = (parts[0] + parts[1]) + parts[2]
    want = (total.bfloat16().float() + res.float()).bfloat16()
    for r in range(3):
        assert torch.equal(ex.read(r, "out"), want)


def test_one_rank_runs_on_the_plain_interpreter() -> None:
    ex = create_executor(compile_graph(_graph(1), 2), "cpu")
    part, res = torch.randn(B, H), torch.randn(B, H).bfloat16()
    ex.bind("p", part)
    ex.bind("res", res)
    ex.bind("out", torch.zeros(B, H, dtype=torch.bfloat16))
    ex.run(1)
    assert torch.equal(ex.read("out"), (part.bfloat16().float() + res.float()).bfloat16())


def test_reference_without_peers_is_refused() -> None:
    g = _graph(2)
    view = g.view(g.ops[0])
    tile = Tile(view, (0, 0, 0), {"partial": torch.zeros(B, H // TILES),
                                  "out": torch.zeros(B, H // TILES, dtype=torch.bfloat16)})
    with pytest.raises(MpkError, match="MultiRankCpuExecutor"):
        get_kind("allreduce").reference(tile)


def test_checks() -> None:
    with pytest.raises(GraphError, match="ranks"):
        _graph(0)
    with pytest.raises(GraphError, match="i32"):
        _graph(2, DType.I32)


def test_plan_rank_count_must_match() -> None:
    with pytest.raises(MpkError, match="sums 3 ranks"):
        MultiRankCpuExecutor([compile_graph(_graph(3), 2)] * 2)


def test_only_allreduce_megakernels_hand_tasks_the_launch_params() -> None:
    """MPK_TASK_PARAMS (TaskArgs::p, a __grid_constant__ kernel parameter) is compiled in only
    when a kind reads it: single-GPU megakernels keep the code measured on the H200."""
    assert "#define MPK_TASK_PARAMS 1" in codegen.render(compile_graph(_graph(2), 2))
    assert "MPK_TASK_PARAMS" not in codegen.render_kinds(["linear", "rmsnorm"])
