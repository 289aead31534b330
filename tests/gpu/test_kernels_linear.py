"""The streamed linear kernel (tasks/linear/sm90.cuh) against the CPU interpreter: prologues,
epilogues, uneven task ranges, K tails and chunks, batch 1-16 (kernel_helpers.py: poisoned
outputs, bf16 tolerance)."""

from __future__ import annotations

import math

import pytest
import torch

from mpk.graph.graph import Graph
from mpk.compiler.lower import compile_graph
from tests.gpu.kernel_helpers import (BF16, F32, I32, Role, assert_close, gen, randn, run_both,
                                      run_on)

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]


def linear_graph(batch: int, n: int, k: int, wshape: tuple[int, ...], prologue: str,
                 out_dtype) -> tuple[Graph, dict[str, str]]:
    """x [batch, k] -> y [batch, n] through weight w (and norm weight nw with an rmsnorm
    prologue): the graph's tensors and the linear op's operands."""
    graph = Graph()
    graph.add_tensor("x", (batch, k), BF16, Role.IO)
    graph.add_tensor("w", wshape, BF16, Role.WEIGHT)
    graph.add_tensor("y", (batch, n), out_dtype, Role.ACTIVATION)
    operands = {"x": "x", "weight": "w", "out": "y"}
    if prologue == "rmsnorm":
        graph.add_tensor("nw", (k,), BF16, Role.WEIGHT)
        operands["norm_weight"] = "nw"
    return graph, operands


def linear_case(n: int, k: int, tasks: int, batch: int, prologue: str = "none",
                epilogue: str = "none", residual: bool = False, out_dtype=BF16,
                seed: int = 0, num_sms: int = 16) -> None:
    g = gen(seed)
    silu = epilogue == "silu_mul"
    wshape = (2, n, k) if silu else (n, k)
    graph, operands = linear_graph(batch, n, k, wshape, prologue, out_dtype)
    inputs = {"x": randn((batch, k), torch.bfloat16, g, 2.0),
              "w": randn(wshape, torch.bfloat16, g, 1.0 / math.sqrt(k))}
    outputs = ["y"]
    if prologue == "rmsnorm":
        inputs["nw"] = (1.0 + 0.5 * torch.randn(k, generator=g)).to(torch.bfloat16)
    if residual:
        graph.add_tensor("r", (batch, n), out_dtype, Role.IO)
        inputs["r"] = randn((batch, n), out_dtype.torch, g, 3.0)
        operands["residual"] = "r"
    if epilogue == "argmax":
        graph.add_tensor("pv", (batch, tasks), F32, Role.ACTIVATION)
        graph.add_tensor("pi", (batch, tasks), I32, Role.ACTIVATION)
        operands.update(part_val="pv", part_idx="pi")
        outputs += ["pv", "pi"]
    graph.add_op("linear", "lin", (tasks,), operands=operands, prologue=prologue,
                 epilogue=epilogue)
    cpu, gpu = run_both(graph, inputs, outputs, num_sms=num_sms)
    assert_close(cpu["y"], gpu["y"], "y")
    if epilogue == "argmax":
        # Each task's best among ITS OWN stored outputs: the indices must agree exactly unless
        # the two backends' values differ at a near-tie inside a task.
        close = (cpu["pi"] == gpu["pi"]) | ((cpu["pv"] - gpu["pv"]).abs() < 1e-2)
        assert close.all(), (cpu["pi"], gpu["pi"])


@pytest.mark.parametrize("batch", [1, 3, 8, 16])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm"])
def test_linear_plain(batch, prologue):
    linear_case(1024, 1024, 128, batch, prologue, residual=batch % 2 == 1, seed=batch)


@pytest.mark.parametrize("n,k,tasks,batch", [
    (200, 576, 13, 3),     # SmolLM2's K (18 units per row group), uneven 8-row ranges
    (96, 48, 5, 5),        # K smaller than one 8-warp sweep, a 16-k tail
    (17, 64, 3, 2),        # N not a multiple of 8: a partial row group
    (4096, 1024, 132, 1),  # qwen3-0.6b qkv shape, one task per SM
    (2064, 512, 1, 2),     # one task: blocks of 8, 8, ... then 2
])
def test_linear_shapes(n, k, tasks, batch):
    linear_case(n, k, tasks, batch, "rmsnorm", residual=True, seed=n + k)


@pytest.mark.parametrize("batch", [1, 8, 16])
def test_linear_chunked_k(batch):
    """K x batch past the staging budget: the input comes in chunks, sums carry in fp32."""
    linear_case(64, 14336, 4, batch, residual=True, seed=batch)


@pytest.mark.parametrize("n,k,tasks,batch", [(72, 8192, 5, 16), (72, 12288, 5, 3),
                                             (256, 8192, 2, 16), (256, 12288, 2, 3)])
def test_linear_chunked_k_rmsnorm(n, k, tasks, batch):
    """Chunks with an rmsnorm prologue: the rows' sums of squares add up chunk by chunk and
    scale the outputs after the last (2 row groups a task at 5 tasks, blocks of 8 at 2); K past
    the 8,192 a norm-weight page once held."""
    linear_case(n, k, tasks, batch, "rmsnorm", residual=True, seed=11)


@pytest.mark.parametrize("n,k,tasks,batch", [(3072, 1024, 132, 1), (1536, 576, 132, 4),
                                             (30, 96, 4, 2), (40, 8192, 3, 16),
                                             (1000, 1024, 33, 12)])
def test_linear_silu_epilogue(n, k, tasks, batch):
    linear_case(n, k, tasks, batch, "rmsnorm", "silu_mul", seed=n)


@pytest.mark.parametrize("residual", [False, True])
def test_linear_f32_out(residual):
    linear_case(512, 2048, 8, 2, "rmsnorm", residual=residual, out_dtype=F32)


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_linear_argmax_epilogue(batch):
    linear_case(20000, 1024, 132, batch, "rmsnorm", "argmax", out_dtype=F32, seed=batch,
                num_sms=132)


def test_linear_argmax_samples_like_the_interpreter():
    """Sampling in lm_head's argmax epilogue and argmax_reduce: plain temperature, top-k, top-p
    and both, two rows in runs (their draws follow their positions); the GPU draws the
    interpreter's tokens (the same counter-based noise and integer
    masses; a float log or exp may differ in its last bit, so a rare near-tie may flip)."""
    from mpk.models import decode_io as io
    from mpk.tasks.sampling import encode
    from mpk.testing import sampling_head_graph

    vocab, k, steps, tasks = 5000, 64, 64, 7
    rows = [(0.7, 1, 0, 1.0), (0.0, 2, 0, 1.0), (1.3, 2**40 + 5, 0, 1.0), (0.8, 3, 40, 1.0),
            (1.0, 4, 0, 0.8), (0.9, 5, 200, 0.6)]
    batch = len(rows)
    g = gen(3)
    graph = sampling_head_graph(batch, vocab, k, tasks, steps, runs=True)
    x = randn((batch, k), torch.bfloat16, g, scale=0.25)  # logits std ~2: spread-out draws
    inputs = {"x": x, "w": randn((vocab, k), torch.bfloat16, g),
              io.SAMPLING: torch.tensor([encode(*r) for r in rows], dtype=torch.int32),
              io.POSITIONS: torch.tensor([0, 3, 100, 7, 9, 11], dtype=torch.int32),
              # rows 2 and 4 are in runs of 3 and 2 rows: their positions move 3 and 2 a step
              io.RUNS: torch.tensor([[0, 1], [0, 1], [2, 3], [0, 1], [1, 2], [0, 0]],
                                    dtype=torch.int32),
              "tokens_out": torch.zeros(steps, batch, dtype=torch.int32)}
    cpu, gpu = run_both(graph, inputs, ["tokens_out"], steps=steps, num_sms=8)
    same = (cpu["tokens_out"] == gpu["tokens_out"]).float().mean(dim=0)
    assert bool((same >= 0.97).all()), (same, cpu["tokens_out"][:8], gpu["tokens_out"][:8])
    assert bool((cpu["tokens_out"][:, 1] == gpu["tokens_out"][:, 1]).all())  # greedy: exact

@pytest.mark.parametrize("out_dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("k,xc,prologue,tasks", [(1024, 0, "rmsnorm", 16), (3072, 0, "none", 16),
                                                 (8192, 2048, "rmsnorm", 16),
                                                 (1024, 0, "rmsnorm", 2),
                                                 (8192, 2048, "rmsnorm", 2)])
def test_linear_row_does_not_depend_on_the_batch(k, xc, prologue, tasks, out_dtype):
    """One input row's outputs are bit-identical at batch 1, 8 and 16 (the same input chunks:
    xc) in whichever row it sits, with other rows beside it: the serving engine's one-row plan
    must round a request's row as its 16-row plan does in any of its rows (engine/scheduler.py),
    so a row's MMAs sum its units in the same order at every batch and row (linear/sm90_walk.cuh
    Chains). Batch 9-16 takes the wide walk (rows 8-15 on their own MMAs). fp32 outputs show any
    change in the order of the sums; bf16 outputs hide most of them (one chain a wide row failed
    only the chunked bf16 case: perf-log, twenty-eighth session). 16 tasks give 4 row groups a
    task (a block of 4: the warps' partial sums added up in warp order), 2 tasks 32 (blocks of
    8: each warp writes its own row group)."""
    n = 512
    g = gen(k)
    row0 = randn((1, k), torch.bfloat16, g, 2.0)
    weights = {"w": randn((n, k), torch.bfloat16, g, 1.0 / math.sqrt(k)),
               "nw": (1.0 + 0.5 * torch.randn(k, generator=g)).to(torch.bfloat16)}
    rows = {}
    for batch in (1, 8, 16):
        graph, operands = linear_graph(batch, n, k, (n, k), prologue, out_dtype)
        graph.add_op("linear", "lin", (tasks,), operands=operands, prologue=prologue, xc=xc)
        x = randn((batch, k), torch.bfloat16, g, 2.0)
        same = _rows_of(batch)
        x[same] = row0
        inputs = {"x": x, **{name: w for name, w in weights.items() if name in operands.values()}}
        got = run_on(compile_graph(graph, num_sms=16), "cuda", inputs, ["y"])["y"]
        rows.update({(batch, r): got[r] for r in same})
    _assert_all_equal(rows)


@pytest.mark.parametrize("k", [1024, 2048])
def test_linear_polled_and_copied_rows_round_alike(k):
    """An rmsnorm linear fed by another linear's output: a flagged activation (up to 32 KB) is
    polled into place, a larger one copied. One input row's outputs are bit-identical at batch 1
    (polled) and 16 (polled at k 1,024; copied at 2,048, whose 64 KB is past the flags' limit)
    in whichever row it sits, and batch 16 matches the interpreter: the serving engine's
    one-row plan polls what its 16-row plan may copy (llama-3.2-1b's hidden)."""
    n, tasks = 512, 16
    g = gen(k + 1)
    row0 = randn((1, k), torch.bfloat16, g, 2.0)
    weights = {"w0": randn((k, k), torch.bfloat16, g, 1.0 / math.sqrt(k)),
               "w": randn((n, k), torch.bfloat16, g, 1.0 / math.sqrt(k)),
               "nw": (1.0 + 0.5 * torch.randn(k, generator=g)).to(torch.bfloat16)}
    rows = {}
    for batch in (1, 16):
        graph, operands = linear_graph(batch, n, k, (n, k), "rmsnorm", F32)
        graph.add_tensor("w0", (k, k), BF16, Role.WEIGHT)
        graph.add_tensor("h", (batch, k), BF16, Role.ACTIVATION)
        graph.add_op("linear", "lin0", (tasks,), operands={"x": "x", "weight": "w0", "out": "h"})
        graph.add_op("linear", "lin", (tasks,), operands={**operands, "x": "h"},
                     prologue="rmsnorm")
        x = randn((batch, k), torch.bfloat16, g, 2.0)
        same = _rows_of(batch)
        x[same] = row0
        inputs = {"x": x, **weights}
        plan = compile_graph(graph, num_sms=16)
        flagged = {t.name for t in plan.tensors if t.flagged}
        assert flagged == ({"h"} if batch == 1 or k == 1024 else set()), flagged
        got = run_on(plan, "cuda", inputs, ["y"])["y"]
        if batch == 16:
            assert_close(run_on(plan, "cpu", inputs, ["y"])["y"], got, "y")
        rows.update({(batch, r): got[r] for r in same})
    _assert_all_equal(rows)


def _rows_of(batch: int) -> list[int]:
    """The rows that hold the same input row in a batch of `batch` (row invariance tests)."""
    return [r for r in (0, 3, 8, 15) if r < batch]


def _assert_all_equal(rows: dict[tuple[int, int], torch.Tensor]) -> None:
    """Every (batch, row)'s outputs bit-identical to batch 1's row 0."""
    for (batch, r), y in rows.items():
        assert torch.equal(y, rows[1, 0]), (batch, r, (y - rows[1, 0]).abs().max())
