"""Graph API errors name the layer and the tensor."""

from __future__ import annotations

import pytest
import torch

import mpk
import mpk.compiler.lower
import mpk.tasks.registry
from mpk.dtypes import DType
from mpk.errors import GraphError
from mpk.graph.graph import Graph
from mpk.tensors import Role


def _graph() -> Graph:
    g = Graph()
    g.add_tensor("x", (2, 64), DType.BF16, Role.IO)
    g.add_tensor("w", (96, 64), DType.BF16, Role.WEIGHT)
    g.add_tensor("y", (2, 96), DType.BF16, Role.ACTIVATION)
    return g


def test_wrong_shape_names_layer_and_tensor() -> None:
    g = _graph()
    g.add_tensor("w_bad", (96, 32), DType.BF16, Role.WEIGHT)
    with pytest.raises(GraphError, match=r"layer 'proj'.*'x'.*\(2, 64\)"):
        g.add_op("linear", "proj", (1,), {"x": "x", "weight": "w_bad", "out": "y"})


def test_grid_must_divide_tensor() -> None:
    g = _graph()
    g.add_tensor("nw", (64,), DType.BF16, Role.WEIGHT)
    g.add_tensor("h", (2, 64), DType.BF16, Role.ACTIVATION)
    with pytest.raises(GraphError, match=r"layer 'norm'.*does not divide.*'x'"):
        g.add_op("rmsnorm", "norm", (3,), {"x": "x", "weight": "nw", "out": "h"})


def test_linear_cuts_uneven_aligned_ranges() -> None:
    g = _graph()  # 96 rows = 12 pieces of 8: 5 tasks get 16, 16, 16, 24, 24 rows
    g.add_op("linear", "proj", (5,), {"x": "x", "weight": "w", "out": "y"})
    plan = mpk.compiler.lower.compile_graph(g, num_sms=2)
    view = plan.op_view(0)
    kind = mpk.tasks.registry.get_kind("linear")
    rows = [kind.region(view, "weight", (t, 0, 0))[0] for t in range(5)]
    assert rows == [(0, 16), (16, 32), (32, 56), (56, 72), (72, 96)]
    with pytest.raises(GraphError, match=r"layer 'more'.*larger than the 12 pieces of 8"):
        _graph().add_op("linear", "more", (13,), {"x": "x", "weight": "w", "out": "y"})


def test_uneven_split_bounds_must_fit_32_bits() -> None:
    # The kernels compute uneven split bounds with 32-bit quotients (tasks/common/split.cuh):
    # 2^19 pieces of 8 rows times 2^13 tasks is 2^32, refused when the op is added.
    g = Graph()
    g.add_tensor("x", (1, 8), DType.BF16, Role.IO)
    g.add_tensor("w", (1 << 22, 8), DType.BF16, Role.WEIGHT)
    g.add_tensor("y", (1, 1 << 22), DType.BF16, Role.ACTIVATION)
    with pytest.raises(GraphError, match=r"must stay below 2\^32"):
        g.add_op("linear", "huge", (1 << 13,), {"x": "x", "weight": "w", "out": "y"})
    g.add_op("linear", "fits", ((1 << 13) - 1,), {"x": "x", "weight": "w", "out": "y"})


def test_grid_axis_must_split_outputs() -> None:
    g = _graph()
    g.add_tensor("nw", (64,), DType.BF16, Role.WEIGHT)
    g.add_tensor("h", (2, 64), DType.BF16, Role.ACTIVATION)
    with pytest.raises(GraphError, match="would write the same region"):
        g.add_op("rmsnorm", "norm", (1, 2), {"x": "x", "weight": "nw", "out": "h"})


def test_duplicate_and_invalid_names() -> None:
    g = _graph()
    with pytest.raises(GraphError, match="duplicate tensor"):
        g.add_tensor("x", (1,), DType.F32, Role.IO)
    with pytest.raises(GraphError, match="invalid tensor name"):
        g.add_tensor("1bad name", (1,), DType.F32, Role.IO)
    g.add_op("linear", "proj", (4,), {"x": "x", "weight": "w", "out": "y"})
    with pytest.raises(GraphError, match="duplicate layer"):
        g.add_op("linear", "proj", (4,), {"x": "x", "weight": "w", "out": "y"})


def test_unknown_kind_operand_tensor_and_attr() -> None:
    g = _graph()
    with pytest.raises(GraphError, match="unknown task kind"):
        g.add_op("conv", "c", (1,), {})
    with pytest.raises(GraphError, match="unknown operand 'bias'"):
        g.add_op("linear", "p", (1,), {"x": "x", "weight": "w", "out": "y", "bias": "w"})
    with pytest.raises(GraphError, match="unknown tensor 'nope'"):
        g.add_op("linear", "p", (1,), {"x": "nope", "weight": "w", "out": "y"})
    with pytest.raises(GraphError, match="unknown attribute"):
        g.add_op("linear", "p", (1,), {"x": "x", "weight": "w", "out": "y"}, alpha=2)
    with pytest.raises(GraphError, match="writes weight tensor"):
        g.add_op("linear", "p", (1,), {"x": "x", "weight": "w", "out": "w"})


def test_persistent_kernel_api_runs_a_layer() -> None:
    pk = mpk.PersistentKernel(num_sms=4)
    x = torch.randn(3, 64).bfloat16()
    w = torch.randn(128, 64).bfloat16()
    pk.attach("x", x, io=True)
    pk.attach("w", w)
    pk.new_tensor("y", (3, 128), torch.float32)
    pk.linear("proj", grid=(8,), operands={"x": "x", "weight": "w", "out": "y"})
    kernel = pk.compile(backend="cpu")
    kernel()
    assert torch.allclose(kernel["y"], x.float() @ w.float().T, rtol=1e-5, atol=1e-4)
    with pytest.raises(AttributeError):
        pk.no_such_kind  # noqa: B018


def test_in_place_layer_that_reads_other_tasks_tiles_is_rejected() -> None:
    g = Graph()
    g.add_tensor("x", (2, 64), DType.BF16, Role.IO)
    g.add_tensor("w", (64, 64), DType.BF16, Role.WEIGHT)
    with pytest.raises(GraphError, match="another task of the same layer"):
        g.add_op("linear", "proj", (4,), {"x": "x", "weight": "w", "out": "x"})
    g.add_op("linear", "one_task", (1,), {"x": "x", "weight": "w", "out": "x"})  # one task: fine


def _attention_inputs(g: Graph) -> dict[str, str]:
    """The tensors of a one-head, one-row decode attention op (head_dim 16, two pages of 4)."""
    g.add_tensor("qkv", (1, 48), DType.BF16, Role.ACTIVATION)
    g.add_tensor("positions", (1,), DType.I32, Role.IO)
    g.add_tensor("page_table", (1, 2), DType.I32, Role.IO)
    g.add_tensor("k_cache", (2, 4, 1, 16), DType.BF16, Role.IO)
    g.add_tensor("v_cache", (2, 4, 1, 16), DType.BF16, Role.IO)
    g.add_tensor("attn", (1, 16), DType.BF16, Role.ACTIVATION)
    return {"qkv": "qkv", "rope": "rope", "positions": "positions", "page_table": "page_table",
            "k_cache": "k_cache", "v_cache": "v_cache", "out": "attn"}


def _rope_writer(g: Graph, name: str) -> None:
    """A linear whose f32 output is the tensor attention takes as its RoPE table."""
    g.add_tensor("xr", (8, 16), DType.BF16, Role.IO)
    g.add_tensor("wr", (16, 16), DType.BF16, Role.WEIGHT)
    g.add_op("linear", name, (1,), {"x": "xr", "weight": "wr", "out": "rope"})


def test_prologue_operands_are_never_written() -> None:
    # attention reads its RoPE table before its waits (task.py prologue_operands): nothing would
    # order that read after a task that writes the table, so the graph refuses such a writer,
    # whichever op is added first.
    g = Graph()
    g.add_tensor("rope", (8, 16), DType.F32, Role.ACTIVATION)
    _rope_writer(g, "make_rope")
    with pytest.raises(GraphError, match=r"layer 'attn' \(attention\) reads tensor 'rope' "
                                         r"before its waits.*layer 'make_rope' writes it"):
        g.add_op("attention", "attn", (1, 1, 1), _attention_inputs(g))
    g = Graph()
    g.add_tensor("rope", (8, 16), DType.F32, Role.ACTIVATION)
    g.add_op("attention", "attn", (1, 1, 1), _attention_inputs(g))
    with pytest.raises(GraphError, match=r"layer 'make_rope' \(linear\) writes tensor 'rope', "
                                         r"which layer 'attn' reads before its waits"):
        _rope_writer(g, "make_rope")
