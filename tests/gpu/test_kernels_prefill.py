"""The prefill plan's kernels (gemm, rope_append, attention_prefill, take_row; models/prefill.py)
against the CPU interpreter: ragged rows, columns and K for the GEMM tiles, silu_mul and an
in-place residual; the chunk's queries and keys prepared and appended (rope_append), then causal
attention over cached pages and the chunk, GQA groups whose query vectors straddle passes,
padding rows, invalid page entries, head dims of one to several key quarters per 16-byte copy,
rows past the rope table (kernel_helpers.py: poisoned outputs, bf16 tolerance)."""

from __future__ import annotations

import pytest
import torch

from mpk.graph.graph import Graph
from tests.gpu.kernel_helpers import (BF16, F32, I32, Role, add_qk_norms, assert_close, gen,
                                      randn, rope_table, run_both)

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]


def gemm_case(rows: int, n: int, k: int, grid: tuple[int, int], silu: bool = False,
              residual: str | None = None, seed: int = 0) -> None:
    """residual: None, "separate" (an IO tensor beside out) or "in_place" (out is the
    residual, as the model's o_proj and down write the hidden state)."""
    g = gen(seed)
    graph = Graph()
    wshape = (2, n, k) if silu else (n, k)
    graph.add_tensor("x", (rows, k), BF16, Role.IO)
    graph.add_tensor("w", wshape, BF16, Role.WEIGHT)
    inputs = {"x": randn((rows, k), torch.bfloat16, g),
              "w": randn(wshape, torch.bfloat16, g, k ** -0.5)}
    operands = {"x": "x", "weight": "w", "out": "out"}
    if residual == "in_place":
        graph.add_tensor("out", (rows, n), BF16, Role.IO)
        inputs["out"] = randn((rows, n), torch.bfloat16, g)
        operands["residual"] = "out"
    else:
        graph.add_tensor("out", (rows, n), BF16, Role.ACTIVATION)
    if residual == "separate":
        graph.add_tensor("res", (rows, n), BF16, Role.IO)
        inputs["res"] = randn((rows, n), torch.bfloat16, g)
        operands["residual"] = "res"
    graph.add_op("gemm", "proj", grid, operands=operands,
                 epilogue="silu_mul" if silu else "none")
    cpu, gpu = run_both(graph, inputs, ["out"])
    assert_close(cpu["out"], gpu["out"], "out")


@pytest.mark.parametrize("rows,n,k,grid", [
    (256, 512, 256, (4, 4)),    # whole tiles, one per task
    (100, 200, 72, (3, 1)),     # rows, outputs and K all ragged against the 64 x 128 x 64 tile
    (64, 1032, 520, (2, 1)),    # ranges wider than a tile: several column tiles per task
    (192, 64, 4096, (8, 3)),    # ranges of 8 outputs, long K (64 k tiles through 3 stages)
])
def test_gemm_shapes(rows, n, k, grid):
    gemm_case(rows, n, k, grid, seed=rows + n)


@pytest.mark.parametrize("residual", ["separate", "in_place"])
def test_gemm_residual(residual):
    gemm_case(128, 384, 192, (3, 2), residual=residual, seed=7)


@pytest.mark.parametrize("residual", ["separate", "in_place"])
def test_gemm_residual_several_tiles_a_task(residual):
    """Three row tiles (the last ragged) of two column tiles (the second ragged) a task: each
    tile's stores drain while the next tile's first copies land."""
    gemm_case(300, 776, 200, (2, 1), residual=residual, seed=9)


def test_gemm_silu_mul():
    gemm_case(130, 200, 136, (3, 2), silu=True, seed=11)


def test_gemm_silu_mul_several_tiles_a_task():
    """silu_mul over three row tiles of two column tiles a task (a tile holds 128 gate and 128
    up rows: 400 outputs in two tasks of 200)."""
    gemm_case(260, 400, 264, (2, 1), silu=True, seed=13)


def prefill_attention_graph(group: int, d: int, kv_heads: int = 2, chunk: int = 128,
                            blocks: int = 2, start: int = 0, prompt: int | None = None,
                            qk_norm: bool = True, max_pos: int | None = None,
                            bad_pages: tuple[int, ...] = (), seed: int = 0
                            ) -> tuple[Graph, dict[str, torch.Tensor]]:
    """rope_append then attention_prefill (q -> o) over one sequence: rows 0 .. prompt-1 of a
    chunk of `chunk` rows at positions start ..; the cache holds random keys and values at every
    slot (so positions before `start` are a cached context); `bad_pages`: page-table entries set
    out of the pool (-1). The graph and its inputs."""
    g = gen(seed)
    page_size = 16
    prompt = chunk if prompt is None else prompt
    max_pages = (start + chunk + page_size - 1) // page_size + 1
    num_pages = max_pages + 3
    table = torch.randperm(num_pages, generator=g)[:max_pages].to(torch.int32)
    for index in bad_pages:
        table[index] = -1
    cache = (num_pages, page_size, kv_heads, d)
    max_pos = max_pos or max_pages * page_size
    width = kv_heads * (group + 2) * d
    graph = Graph()
    graph.add_tensor("qkv", (chunk, width), BF16, Role.IO)
    graph.add_tensor("rope", (max_pos, d), F32, Role.WEIGHT)
    for name, shape in (("positions", (1,)), ("chunk", (1,)), ("page_table", (1, max_pages))):
        graph.add_tensor(name, shape, I32, Role.IO)
    graph.add_tensor("k_cache", cache, BF16, Role.IO)
    graph.add_tensor("v_cache", cache, BF16, Role.IO)
    graph.add_tensor("q", (chunk, kv_heads * group * d), BF16, Role.ACTIVATION)
    graph.add_tensor("o", (chunk, kv_heads * group * d), BF16, Role.ACTIVATION)
    seq = {"rope": "rope", "positions": "positions", "chunk": "chunk",
           "page_table": "page_table", "k_cache": "k_cache", "v_cache": "v_cache"}
    operands = {**seq, "qkv": "qkv", "q": "q"}
    inputs = {"qkv": randn((chunk, width), torch.bfloat16, g, 2.0),
              "rope": rope_table(max_pos, d),
              "positions": torch.tensor([start], dtype=torch.int32),
              "chunk": torch.tensor([prompt], dtype=torch.int32),
              "page_table": table[None], "k_cache": randn(cache, torch.bfloat16, g),
              "v_cache": randn(cache, torch.bfloat16, g)}
    if qk_norm:
        add_qk_norms(graph, inputs, operands, d, g)
    graph.add_op("rope_append", "prepare", (kv_heads, blocks), operands=operands)
    graph.add_op("attention_prefill", "attn", (kv_heads, blocks),
                 operands={**seq, "q": "q", "out": "o"})
    return graph, inputs


def prefill_attention_case(*args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    """prefill_attention_graph's q, o and caches: the GPU against the CPU interpreter."""
    graph, inputs = prefill_attention_graph(*args, **kwargs)
    cpu, gpu = run_both(graph, inputs, ["q", "o", "k_cache", "v_cache"])
    assert_close(cpu["q"], gpu["q"], "q")
    assert_close(cpu["o"], gpu["o"], "o")
    assert_close(cpu["k_cache"], gpu["k_cache"], "k_cache")
    assert_close(cpu["v_cache"], gpu["v_cache"], "v_cache", exact=True)


def test_prefill_attention_first_chunk():
    prefill_attention_case(2, 128, chunk=128, blocks=2, seed=1)


def test_prefill_attention_pieces_share_a_pass():
    """G = 4, four row blocks of a 128-row chunk: each task's two 16-row pieces (rows 16j.. and
    112-16j..) are 64 query vectors each, one pass holding both; a cached context, and padding
    rows from 100 on (task 1's second piece is partly real, task 0's all padding)."""
    prefill_attention_case(4, 64, chunk=128, blocks=4, start=45, prompt=100, seed=8)


def test_prefill_attention_a_pass_a_piece():
    """G = 4, 32-row pieces (qwen3-8b's shape at 64 rows a task): 128 vectors, a pass each."""
    prefill_attention_case(4, 64, chunk=128, blocks=2, start=70, seed=10)


def test_prefill_attention_two_passes_a_piece():
    """G = 8: a 32-row piece is 256 query vectors, two passes of its own."""
    prefill_attention_case(8, 64, kv_heads=1, chunk=128, blocks=2, start=3, seed=9)


def test_prefill_attention_after_a_cached_context_with_padding_rows():
    """Positions 100 .. 149 of a 64-row chunk (14 padding rows), G = 4: 256 query vectors of a
    task in two passes over three key blocks (cached 0 .. 99, not block-aligned, then the
    chunk's)."""
    prefill_attention_case(4, 64, chunk=64, blocks=1, start=100, prompt=50, seed=2)


def test_prefill_attention_groups_straddle_passes():
    """G = 3: a row's query heads fall in two passes (each reads the row's key from the
    cache)."""
    prefill_attention_case(3, 64, kv_heads=1, chunk=96, blocks=1, start=37, qk_norm=False,
                           seed=3)


def test_prefill_attention_invalid_page_entries():
    """Entries out of the pool in the cached context and inside the chunk: those positions are
    neither attended nor written."""
    prefill_attention_case(2, 128, chunk=64, blocks=2, start=40, bad_pages=(1, 4), seed=4)


@pytest.mark.parametrize("d", [16, 80])
def test_prefill_attention_scalar_head_dims(d):
    """Head dims of two and ten 16-byte chunks a key: a quarter of one thread's copies, or
    more, and lanes past D in rope_append."""
    prefill_attention_case(2, d, chunk=64, blocks=4, start=20, seed=d)


def test_prefill_attention_rows_past_the_rope_table():
    """A chunk reaching past the rope table: rows from there on are padding."""
    prefill_attention_case(2, 64, chunk=64, blocks=2, start=30, max_pos=70, seed=6)


@pytest.mark.parametrize("n", [1, 37, 64, 0, 99])
def test_take_row(n):
    """chunk[0] = n picks row n - 1, clamped to [1, rows]."""
    g = gen(n)
    graph = Graph()
    graph.add_tensor("x", (64, 96), BF16, Role.IO)
    graph.add_tensor("chunk", (1,), I32, Role.IO)
    graph.add_tensor("out", (1, 96), BF16, Role.ACTIVATION)
    graph.add_op("take_row", "last", (1,), operands={"x": "x", "chunk": "chunk", "out": "out"})
    cpu, gpu = run_both(graph, {"x": randn((64, 96), torch.bfloat16, g),
                                "chunk": torch.tensor([n], dtype=torch.int32)}, ["out"])
    assert_close(cpu["out"], gpu["out"], "out", exact=True)
