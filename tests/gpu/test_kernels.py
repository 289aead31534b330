"""The small kinds' sm_90a kernels against the CPU interpreter (linear and attention have files of
their own; kernel_helpers.py says how a case runs)."""

from __future__ import annotations


import pytest
import torch

from mpk.graph.graph import Graph
from tests.gpu.kernel_helpers import BF16, F32, I32, Role, assert_close, gen, randn, run_both

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]


# ---- rmsnorm, silu_mul, embedding ------------------------------------------------------------
@pytest.mark.parametrize("rows,hidden,grid", [(4, 4096, 4), (4, 4096, 1), (3, 1004, 3),
                                              (8, 2048, 2)])
def test_rmsnorm(rows, hidden, grid):
    g = gen(rows + hidden)
    graph = Graph()
    graph.add_tensor("x", (rows, hidden), BF16, Role.IO)
    graph.add_tensor("w", (hidden,), BF16, Role.WEIGHT)
    graph.add_tensor("y", (rows, hidden), BF16, Role.ACTIVATION)
    graph.add_op("rmsnorm", "norm", (grid,), operands={"x": "x", "weight": "w", "out": "y"})
    inputs = {"x": randn((rows, hidden), torch.bfloat16, g, 3.0),
              "w": (1.0 + 0.5 * torch.randn(hidden, generator=g)).to(torch.bfloat16)}
    cpu, gpu = run_both(graph, inputs, ["y"])
    assert_close(cpu["y"], gpu["y"], "y")


@pytest.mark.parametrize("batch,inter,grid", [(3, 3072, 4), (1, 1004, 2), (8, 1024, 8)])
def test_silu_mul(batch, inter, grid):
    g = gen(inter)
    graph = Graph()
    graph.add_tensor("x", (batch, 2, inter), BF16, Role.IO)
    graph.add_tensor("y", (batch, inter), BF16, Role.ACTIVATION)
    graph.add_op("silu_mul", "act", (grid,), operands={"x": "x", "out": "y"})
    cpu, gpu = run_both(graph, {"x": randn((batch, 2, inter), torch.bfloat16, g, 3.0)}, ["y"])
    assert_close(cpu["y"], gpu["y"], "y")


@pytest.mark.parametrize("with_prompt", [False, True])
def test_embedding(with_prompt):
    g = gen(5)
    batch, vocab, hidden, steps = 3, 1000, 1024, 2
    graph = Graph()
    graph.add_tensor("tokens", (batch,), I32, Role.IO)
    graph.add_tensor("table", (vocab, hidden), BF16, Role.WEIGHT)
    graph.add_tensor("y", (batch, hidden), BF16, Role.ACTIVATION)
    operands = {"tokens": "tokens", "table": "table", "out": "y"}
    inputs = {"tokens": torch.tensor([7, vocab + 50, 999], dtype=torch.int32),  # one clamped
              "table": randn((vocab, hidden), torch.bfloat16, g)}
    if with_prompt:
        graph.add_tensor("prompt", (3, batch), I32, Role.IO)
        operands["prompt"] = "prompt"
        inputs["prompt"] = torch.tensor([[1, 2, 3], [-1, 17, 400], [5, 5, 5]], dtype=torch.int32)
    graph.add_op("embedding", "embed", (4,), operands=operands)
    cpu, gpu = run_both(graph, inputs, ["y"], steps=steps)
    assert_close(cpu["y"], gpu["y"], "y", exact=True)


# ---- argmax ------------------------------------------------------------------------------------
@pytest.mark.parametrize("logits_dtype", [F32, BF16])
@pytest.mark.parametrize("batch", [1, 3])
def test_argmax_partial(batch, logits_dtype):
    g = gen(batch)
    tiles, tile_v = 4, 1200
    vocab = tiles * tile_v
    logits = torch.randn((batch, vocab), generator=g)
    logits[0, 2500] = 50.0        # planted maximum
    if batch > 1:
        logits[1, 10] = 40.0      # tie inside tile 0: the lower index wins
        logits[1, 1000] = 40.0
        logits[1, 1300] = 40.0    # tie in tile 1 (its own partial)
        logits[1, 2399] = 40.0
        logits[2, :] = 1.0        # a constant row: index 0 of every tile
    graph = Graph()
    graph.add_tensor("logits", (batch, vocab), logits_dtype, Role.IO)
    graph.add_tensor("pv", (batch, tiles), F32, Role.ACTIVATION)
    graph.add_tensor("pi", (batch, tiles), I32, Role.ACTIVATION)
    graph.add_op("argmax_partial", "amax", (tiles,),
                 operands={"logits": "logits", "part_val": "pv", "part_idx": "pi"})
    cpu, gpu = run_both(graph, {"logits": logits.to(logits_dtype.torch)}, ["pv", "pi"])
    assert_close(cpu["pi"], gpu["pi"], "part_idx")
    assert_close(cpu["pv"], gpu["pv"], "part_val", exact=True)


@pytest.mark.parametrize("tiles", [4, 128])
@pytest.mark.parametrize("batch", [1, 3])
def test_argmax_reduce(batch, tiles):
    g = gen(batch * tiles)
    steps = 3
    pv = torch.randn((batch, tiles), generator=g)
    pv[0, tiles // 2] = 9.0
    if batch > 1:
        pv[1, 1] = pv[1, tiles - 1] = 9.0  # tie: the first tile wins
        pv[2, :] = 0.5
    pi = torch.randint(0, 150000, (batch, tiles), generator=g, dtype=torch.int32)
    graph = Graph()
    graph.add_tensor("pv", (batch, tiles), F32, Role.IO)
    graph.add_tensor("pi", (batch, tiles), I32, Role.IO)
    graph.add_tensor("tokens", (batch,), I32, Role.IO)
    graph.add_tensor("tokens_out", (steps + 1, batch), I32, Role.IO)
    graph.add_op("argmax_reduce", "sample", (batch,),
                 operands={"part_val": "pv", "part_idx": "pi", "tokens": "tokens",
                           "tokens_out": "tokens_out"})
    inputs = {"pv": pv, "pi": pi, "tokens": torch.full((batch,), -5, dtype=torch.int32),
              "tokens_out": torch.full((steps + 1, batch), -5, dtype=torch.int32)}
    cpu, gpu = run_both(graph, inputs, ["tokens", "tokens_out"], steps=steps)
    assert_close(cpu["tokens"], gpu["tokens"], "tokens")
    assert_close(cpu["tokens_out"], gpu["tokens_out"], "tokens_out")
