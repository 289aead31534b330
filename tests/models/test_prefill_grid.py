"""The prefill plan's gemm grids (models/prefill._gemm_grid): whole row tiles per task, and the
busiest SM's share of tiles as small as the row-block choices allow."""

from __future__ import annotations

import pytest

from mpk.models.config import get_preset
from mpk.models.prefill import GEMM_COLUMNS, GEMM_ROWS, PrefillShape, _gemm_grid, \
    build_prefill_graph


def busiest_tiles(ranges: int, blocks: int, tiles: int, num_sms: int) -> int:
    """Row tiles on the SM with the most tasks when equal tasks are spread evenly."""
    return -(-ranges * blocks // num_sms) * (tiles // blocks)


def test_qwen3_8b_at_1024_rows_loads_the_busiest_sm_least() -> None:
    # qkv: 48 ranges x 8 blocks of one tile (3 on the busiest SM; 4 blocks of two: 4).
    assert _gemm_grid(6144, 1024, 132) == (48, 8)
    # gate_up (64 outputs a task): 192 x 2 blocks of four tiles (12; one block of 8: 16).
    assert _gemm_grid(12288, 1024, 132, GEMM_COLUMNS // 2) == (192, 2)


@pytest.mark.parametrize(("outputs", "chunk", "columns"), [
    (6144, 1024, 128), (4096, 1024, 128), (12288, 1024, 64), (4096, 2048, 128),
    (6144, 2048, 128), (4096, 256, 128), (3072, 256, 64), (1024, 512, 128),
    (1024, 1024, 128), (40, 1024, 128)])
def test_no_row_block_choice_loads_the_busiest_sm_less(outputs: int, chunk: int,
                                                       columns: int) -> None:
    ranges, blocks = _gemm_grid(outputs, chunk, 132, columns)
    tiles = -(-chunk // GEMM_ROWS)
    assert tiles % blocks == 0  # whole tiles per block
    if ranges == -(-outputs // columns):  # tile-wide ranges
        best = min(busiest_tiles(ranges, b, tiles, 132) for b in range(1, tiles + 1)
                   if tiles % b == 0)
        assert busiest_tiles(ranges, blocks, tiles, 132) == best
    else:  # too few tiles for the SMs: narrower ranges, one tile each, at most a task per SM
        assert blocks == tiles and ranges * blocks <= 132
        assert ranges * blocks > 132 - blocks or ranges == outputs // 8


def test_the_qwen3_8b_prefill_graph_uses_these_grids() -> None:
    graph = build_prefill_graph(get_preset("qwen3-8b"), PrefillShape(chunk=1024), 132)
    grids = {op.name.split(".")[-1]: op.grid for op in graph.ops
             if op.kind == "gemm" and op.name.startswith("layers.0.")}
    assert grids["qkv"][:2] == (48, 8) and grids["gate_up"][:2] == (192, 2)


def test_narrow_ranges_never_put_two_tasks_on_an_sm() -> None:
    # qwen3-0.6b's o_proj at C 1024: 8 tile-wide ranges x 8 row blocks leave 68 SMs idle; 17
    # narrower ranges (136 tasks) gave 4 SMs two full tiles each, 16 give every SM at most one.
    assert _gemm_grid(1024, 1024, 132) == (16, 8)
