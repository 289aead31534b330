"""Every task kind's sm_90a kernel (mpk/tasks/<kind>/sm90.cuh) against the CPU interpreter.

Each case is a one-op graph compiled with compile_graph and run by both executors on the same
random inputs (inputs are IO tensors bound to both; outputs are arena activations, poisoned on
both sides, so an element the kernel forgets to write shows up as NaN / poison). Integer outputs
and pure copies must match exactly; float outputs to ||gpu - cpu|| / ||cpu|| <= 1e-2.
"""

from __future__ import annotations

import math

import pytest
import torch

from mpk.backends.base import create_executor
from mpk.compiler.lower import compile_graph
from mpk.dtypes import DType
from mpk.graph.graph import Graph
from mpk.tasks.registry import get_kind

try:
    from mpk.tensors import Role
except ImportError:  # older layout
    from mpk.graph.tensor import Role  # type: ignore[no-redef]

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]

NUM_SMS = 16
RTOL = 1e-2
BF16, F32, I32 = DType.BF16, DType.F32, DType.I32


# ---- helpers ---------------------------------------------------------------------------------
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype: torch.dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def run_both(graph: Graph, inputs: dict[str, torch.Tensor], outputs: list[str],
             steps: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run the graph on the CPU interpreter and on the GPU; return both sets of outputs."""
    plan = compile_graph(graph, num_sms=NUM_SMS)
    got = {}
    for backend in ("cpu", "cuda"):
        ex = create_executor(plan, backend, poison=True)
        # Keep every bound tensor alive while the executor lives (an executor may key caches by
        # data pointer).
        bound = {name: value.clone() for name, value in inputs.items()}
        for name, value in bound.items():
            ex.bind(name, value)
        ex.run(steps)
        got[backend] = {name: ex.read(name).cpu() for name in outputs}
        del ex, bound
    return got["cpu"], got["cuda"]


def assert_close(cpu: torch.Tensor, gpu: torch.Tensor, name: str, exact: bool = False) -> None:
    assert cpu.shape == gpu.shape and cpu.dtype == gpu.dtype, name
    if not cpu.dtype.is_floating_point or exact:
        if cpu.dtype.is_floating_point:
            assert not torch.isnan(gpu).any(), f"{name}: NaN on the GPU"
            assert torch.equal(cpu.view(torch.int16 if cpu.dtype == torch.bfloat16 else
                                        torch.int32),
                               gpu.view(torch.int16 if gpu.dtype == torch.bfloat16 else
                                        torch.int32)), f"{name}: not bit-identical"
        else:
            diff = (cpu != gpu).nonzero()
            assert diff.numel() == 0, f"{name}: {len(diff)} mismatches, first at {diff[:4].tolist()}"
        return
    c, g = cpu.double(), gpu.double()
    assert not torch.isnan(c).any(), f"{name}: NaN in the CPU reference (test bug)"
    assert not torch.isnan(g).any(), (f"{name}: {int(torch.isnan(g).sum())} NaN on the GPU "
                                      f"(unwritten or wrong elements)")
    inf_c, inf_g = torch.isinf(c), torch.isinf(g)
    assert torch.equal(inf_c, inf_g), f"{name}: infinities differ"
    assert torch.equal(c[inf_c], g[inf_g]), f"{name}: infinities differ in sign"
    c, g = c[~inf_c], g[~inf_g]
    ref = c.norm().item()
    err = (g - c).norm().item()
    assert err <= RTOL * max(ref, 1e-30), f"{name}: relative error {err / max(ref, 1e-30):.3e}"


def has_param(kind: str, name: str) -> bool:
    return any(p.name == name for p in get_kind(kind).params)


# ---- linear ----------------------------------------------------------------------------------
# (weight shape, grid): 32-row tiles, 24-row tiles, stacked with one matrix per tile, stacked
# with 3 matrices x 16 rows per tile.
LINEAR_SHAPES = {
    "2d_32rows": ((256, 1024), (8,)),
    "2d_24rows": ((192, 4096), (8,)),
    "stack_1x32": ((2, 128, 1024), (2, 4)),
    "stack_3x16": ((3, 64, 1024), (1, 4)),
}


def linear_case(wshape, grid, batch, prologue="none", residual=False, out_dtype=BF16, seed=0):
    g = gen(seed)
    k = wshape[-1]
    graph = Graph()
    x_shape = (batch, 2, k) if prologue == "silu_mul" else (batch, k)
    out_shape = (batch, *wshape[:-1])
    graph.add_tensor("x", x_shape, BF16, Role.IO)
    graph.add_tensor("w", wshape, BF16, Role.WEIGHT)
    graph.add_tensor("y", out_shape, out_dtype, Role.ACTIVATION)
    inputs = {"x": randn(x_shape, torch.bfloat16, g, 2.0),
              "w": randn(wshape, torch.bfloat16, g, 1.0 / math.sqrt(k))}
    operands = {"x": "x", "weight": "w", "out": "y"}
    if prologue == "rmsnorm":
        graph.add_tensor("nw", (k,), BF16, Role.WEIGHT)
        inputs["nw"] = (1.0 + 0.5 * torch.randn(k, generator=g)).to(torch.bfloat16)
        operands["norm_weight"] = "nw"
    if residual:
        graph.add_tensor("r", out_shape, out_dtype, Role.IO)
        inputs["r"] = randn(out_shape, out_dtype.torch, g, 3.0)
        operands["residual"] = "r"
    graph.add_op("linear", "lin", grid, operands=operands, prologue=prologue)
    cpu, gpu = run_both(graph, inputs, ["y"])
    assert_close(cpu["y"], gpu["y"], "y")


@pytest.mark.parametrize("shape", sorted(LINEAR_SHAPES))
@pytest.mark.parametrize("batch", [1, 4, 8])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("prologue", ["none", "rmsnorm", "silu_mul"])
def test_linear(shape, batch, residual, prologue):
    wshape, grid = LINEAR_SHAPES[shape]
    linear_case(wshape, grid, batch, prologue, residual, seed=batch * 7 + residual)


@pytest.mark.parametrize("residual", [False, True])
def test_linear_f32_out(residual):
    linear_case((512, 2048), (8,), 2, "rmsnorm", residual, out_dtype=F32)


@pytest.mark.parametrize("case", [
    ((64, 1064), (8,), 3, "none"),        # 8-row tiles, K not a multiple of 128 (tail items)
    ((80, 1004), (2,), 2, "rmsnorm"),     # K % 8 != 0: scalar fallback path
    ((40, 2048), (1,), 5, "silu_mul"),    # one task, 40 rows (8-row groups, partial)
    ((64, 14336), (8,), 8, "silu_mul"),   # 8 rows x 14336 x 3 buffers: K processed in chunks
    ((64, 8192), (4,), 8, "rmsnorm"),     # 8 rows of 8192 in shared memory
    ((96, 1024), (2,), 12, "rmsnorm"),    # batch > 8: rows in groups of 8
    ((2064, 512), (1,), 2, "rmsnorm"),    # 2064-row tile: several row blocks
])
def test_linear_edge_shapes(case):
    wshape, grid, batch, prologue = case
    linear_case(wshape, grid, batch, prologue, residual=True, seed=batch)


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


# ---- qk_rope_append ---------------------------------------------------------------------------
def rope_table(max_pos: int, d: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).float()


def paged_cache_setup(g, batch, kv_heads, d, page_size, max_pages):
    num_pages = batch * max_pages
    table = torch.randperm(num_pages, generator=g).to(torch.int32).reshape(batch, max_pages)
    shape = (num_pages, page_size, kv_heads, d)
    return table, randn(shape, torch.bfloat16, g), randn(shape, torch.bfloat16, g)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [2, 4])
def test_qk_rope_append(group, d, qk_norm):
    g = gen(group * d + qk_norm)
    batch, kv_heads, page_size, max_pages, max_pos = 3, 2, 16, 8, 128
    width = (group + 2) * d
    table, kc, vc = paged_cache_setup(g, batch, kv_heads, d, page_size, max_pages)
    graph = Graph()
    graph.add_tensor("qkv", (batch, kv_heads, width), BF16, Role.IO)
    graph.add_tensor("rope", (max_pos, d), F32, Role.WEIGHT)
    graph.add_tensor("positions", (batch,), I32, Role.IO)
    graph.add_tensor("page_table", (batch, max_pages), I32, Role.IO)
    graph.add_tensor("q", (batch, kv_heads, group * d), BF16, Role.ACTIVATION)
    graph.add_tensor("k_cache", kc.shape, BF16, Role.IO)
    graph.add_tensor("v_cache", vc.shape, BF16, Role.IO)
    operands = {"qkv": "qkv", "rope": "rope", "positions": "positions", "page_table": "page_table",
                "q_out": "q", "k_cache": "k_cache", "v_cache": "v_cache"}
    inputs = {"qkv": randn((batch, kv_heads, width), torch.bfloat16, g, 2.0),
              "rope": rope_table(max_pos, d),
              "positions": torch.tensor([0, 17, 100], dtype=torch.int32),
              "page_table": table, "k_cache": kc, "v_cache": vc}
    if qk_norm:
        for name in ("q_norm", "k_norm"):
            graph.add_tensor(name, (d,), BF16, Role.WEIGHT)
            inputs[name] = (1.0 + 0.5 * torch.randn(d, generator=g)).to(torch.bfloat16)
            operands[name] = name
    # One KV head per task; a task with every head only when the kind says how many it has.
    grid = (1,) if has_param("qk_rope_append", "heads_per_task") else (kv_heads,)
    graph.add_op("qk_rope_append", "rope_append", (kv_heads,), operands=operands)
    cpu, gpu = run_both(graph, inputs, ["q", "k_cache", "v_cache"], steps=2)
    assert_close(cpu["q"], gpu["q"], "q_out")
    assert_close(cpu["k_cache"], gpu["k_cache"], "k_cache")
    assert_close(cpu["v_cache"], gpu["v_cache"], "v_cache", exact=True)
    if grid != (kv_heads,):
        graph2 = Graph()
        for spec in graph.tensors.values():
            graph2.add_tensor(spec.name, spec.shape, spec.dtype, spec.role)
        graph2.add_op("qk_rope_append", "rope_append", grid, operands=operands)
        cpu, gpu = run_both(graph2, inputs, ["q", "k_cache", "v_cache"], steps=1)
        assert_close(cpu["q"], gpu["q"], "q_out (all heads in one task)")
        assert_close(cpu["k_cache"], gpu["k_cache"], "k_cache (all heads in one task)")


# ---- attention ---------------------------------------------------------------------------------
def attention_case(group, d, splits, heads_per_task, lengths=(1, 17, 300), steps=1, seed=0):
    g = gen(seed)
    batch, kv_heads, page_size = len(lengths), 2, 16
    max_pages = (max(lengths) + steps + page_size - 1) // page_size + 1
    table, kc, vc = paged_cache_setup(g, batch, kv_heads, d, page_size, max_pages)
    graph = Graph()
    graph.add_tensor("q", (batch, kv_heads, group * d), BF16, Role.IO)
    graph.add_tensor("k_cache", kc.shape, BF16, Role.IO)
    graph.add_tensor("v_cache", vc.shape, BF16, Role.IO)
    graph.add_tensor("page_table", (batch, max_pages), I32, Role.IO)
    graph.add_tensor("positions", (batch,), I32, Role.IO)
    operands = {"q": "q", "k_cache": "k_cache", "v_cache": "v_cache",
                "page_table": "page_table", "positions": "positions"}
    if splits == 1:
        graph.add_tensor("o", (batch, kv_heads, group * d), BF16, Role.ACTIVATION)
        operands["out"] = "o"
        outputs = ["o"]
    else:
        graph.add_tensor("po", (batch, kv_heads, splits, group * d), F32, Role.ACTIVATION)
        graph.add_tensor("pl", (batch, kv_heads, splits, group), F32, Role.ACTIVATION)
        operands["part_o"], operands["part_lse"] = "po", "pl"
        outputs = ["po", "pl"]
    graph.add_op("attention", "attn", (kv_heads // heads_per_task, batch, splits),
                 operands=operands)
    inputs = {"q": randn((batch, kv_heads, group * d), torch.bfloat16, g, 2.0),
              "k_cache": kc, "v_cache": vc, "page_table": table,
              "positions": torch.tensor([n - 1 for n in lengths], dtype=torch.int32)}
    cpu, gpu = run_both(graph, inputs, outputs, steps=steps)
    for name in outputs:
        assert_close(cpu[name], gpu[name], name)


@pytest.mark.parametrize("heads_per_task", [1, 2])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("splits", [1, 4])
def test_attention(splits, group, d, heads_per_task):
    attention_case(group, d, splits, heads_per_task, seed=splits * 100 + group * 10 + d)


@pytest.mark.parametrize("group,splits", [(8, 2), (12, 1), (1, 3)])
def test_attention_groups(group, splits):
    attention_case(group, 128, splits, 1, lengths=(5, 260), seed=group)


def test_attention_steps_and_long():
    attention_case(4, 128, 4, 1, lengths=(2000, 33), steps=2, seed=3)


# ---- attention_merge ---------------------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("splits", [2, 4])
def test_attention_merge(splits, group, d):
    g = gen(splits * group + d)
    batch, kv_heads = 3, 2
    width = group * d
    graph = Graph()
    graph.add_tensor("po", (batch, kv_heads, splits, width), F32, Role.IO)
    graph.add_tensor("pl", (batch, kv_heads, splits, group), F32, Role.IO)
    graph.add_tensor("o", (batch, kv_heads, width), BF16, Role.ACTIVATION)
    graph.add_op("attention_merge", "merge", (kv_heads, batch),
                 operands={"part_o": "po", "part_lse": "pl", "out": "o"})
    po = torch.randn((batch, kv_heads, splits, width), generator=g)
    pl = torch.randn((batch, kv_heads, splits, group), generator=g) * 3.0
    pl[0, 0, splits - 1, :] = -math.inf  # an empty split: weight 0
    po[0, 0, splits - 1, :] = 0.0
    pl[1, 1, :, 0] = -math.inf           # a head with every split empty: output 0
    po[1, 1, :, :d] = 0.0
    cpu, gpu = run_both(graph, {"po": po, "pl": pl}, ["o"])
    assert_close(cpu["o"], gpu["o"], "o")


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
    graph.add_op("argmax_reduce", "sample", (1,),
                 operands={"part_val": "pv", "part_idx": "pi", "tokens": "tokens",
                           "tokens_out": "tokens_out"})
    inputs = {"pv": pv, "pi": pi, "tokens": torch.full((batch,), -5, dtype=torch.int32),
              "tokens_out": torch.full((steps + 1, batch), -5, dtype=torch.int32)}
    cpu, gpu = run_both(graph, inputs, ["tokens", "tokens_out"], steps=steps)
    assert_close(cpu["tokens"], gpu["tokens"], "tokens")
    assert_close(cpu["tokens_out"], gpu["tokens_out"], "tokens_out")
