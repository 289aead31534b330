"""The prefill plan's gemm grids (models/prefill._gemm_grid): whole row tiles per task, the
busiest SM's share of tiles as small as the row-block choices allow, and of the kernel's two
tile widths the one that gives the busiest SM the least tile time; and where its rope_append
tasks land."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from mpk.compiler import record
from mpk.compiler.lower import compile_graph
from mpk.models.config import get_preset
from mpk.models.prefill import (GEMM_ROWS, WIDE_TILE_COST, PrefillShape, _gemm_grid,
                                _gemm_grid_for, build_prefill_graph)
from mpk.tasks.gemm.task import BN_WIDE, tile_width


def busiest_tiles(ranges: int, blocks: int, tiles: int, num_sms: int) -> int:
    """Row tiles on the SM with the most tasks when equal tasks are spread evenly."""
    return -(-ranges * blocks // num_sms) * (tiles // blocks)


def test_qwen3_8b_at_1024_rows_loads_the_busiest_sm_least() -> None:
    # Narrow tiles. qkv: 48 ranges x 8 blocks of one tile (3 on the busiest SM; 4 blocks of
    # two: 4). gate_up (64 outputs a task): 192 x 2 blocks of four tiles (12; one block of 8: 16).
    assert _gemm_grid_for(6144, 1024, 132, 128) == (48, 8)
    assert _gemm_grid_for(12288, 1024, 132, 64) == (192, 2)
    # Both widths: qkv keeps the narrow tiles (3 against 2 wide ones on the busiest SM, 3.08);
    # gate_up takes 96 wide ranges x 4 blocks (6 wide tiles, 9.2 narrow ones' time, against 12);
    # o_proj and down one wide tile a task on 128 SMs (1.54 against 2).
    assert _gemm_grid(6144, 1024, 132) == (48, 8)
    assert _gemm_grid(12288, 1024, 132, silu=True) == (96, 4)
    assert _gemm_grid(4096, 1024, 132) == (16, 8)


def tile_time(outputs: int, chunk: int, grid: tuple[int, int], silu: bool) -> float:
    """The busiest SM's tile time in narrow tiles, for equal tasks spread evenly."""
    ranges, blocks = grid
    wide = tile_width(-(-outputs // ranges), silu) == BN_WIDE
    tiles = -(-chunk // GEMM_ROWS) // blocks
    return -(-ranges * blocks // 132) * tiles * (WIDE_TILE_COST if wide else 1.0)


@pytest.mark.parametrize(("outputs", "silu"), [(6144, False), (4096, False), (12288, True),
                                               (1024, False), (3072, True), (40, False)])
@pytest.mark.parametrize("chunk", [256, 1024, 2048])
def test_the_grid_takes_the_cheaper_tile_width(outputs: int, silu: bool, chunk: int) -> None:
    grid = _gemm_grid(outputs, chunk, 132, silu=silu)
    per_tile = 2 if silu else 1
    options = [_gemm_grid_for(outputs, chunk, 132, bn // per_tile) for bn in (128, 256)]
    assert grid in options
    assert tile_time(outputs, chunk, grid, silu) == min(
        tile_time(outputs, chunk, g, silu) for g in options)


@pytest.mark.parametrize(("outputs", "chunk", "columns"), [
    (6144, 1024, 128), (4096, 1024, 128), (12288, 1024, 64), (4096, 2048, 128),
    (6144, 2048, 128), (4096, 256, 128), (3072, 256, 64), (1024, 512, 128),
    (1024, 1024, 128), (40, 1024, 128)])
def test_no_row_block_choice_loads_the_busiest_sm_less(outputs: int, chunk: int,
                                                       columns: int) -> None:
    ranges, blocks = _gemm_grid_for(outputs, chunk, 132, columns)
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
    assert grids["qkv"][:2] == (48, 8) and grids["gate_up"][:2] == (96, 4)
    assert grids["o_proj"][:2] == (16, 8) and grids["down"][:2] == (16, 8)


def test_narrow_ranges_never_put_two_tasks_on_an_sm() -> None:
    # qwen3-0.6b's o_proj at C 1024: 8 tile-wide ranges x 8 row blocks leave 68 SMs idle; 17
    # narrower ranges (136 tasks) gave 4 SMs two full tiles each, 16 give every SM at most one.
    assert _gemm_grid(1024, 1024, 132) == (16, 8)


def test_rope_append_tasks_are_spread_over_the_sms() -> None:
    """qwen3-8b at 2,048 rows: 384 qkv tiles leave 12 SMs a tile fewer. Costed by bytes alone
    (~6 us against the 34 measured), list scheduling stacked 14-15 of a layer's 256
    rope_append tasks on each of those 12 and none on 38 others, and they ran one after another
    (perf-log, thirty-fifth session); with its round trips counted (TaskCost.round_trips) no SM
    holds more than half that, and every SM takes part."""
    cfg = dataclasses.replace(get_preset("qwen3-8b"), num_layers=2)
    pages = -(-(2048 + 16) // 16)
    shape = PrefillShape(chunk=2048, page_size=16, max_pages=pages, num_pages=pages)
    plan = compile_graph(build_prefill_graph(cfg, shape, 132), 132)
    op = next(o for o in plan.ops if o.name == "layers.0.rope_append")
    tasks = np.arange(op.first_task, op.first_task + math.prod(op.grid))
    per_sm = [int(np.isin(plan.instrs[sm, :plan.lengths[sm], record.TASK], tasks).sum())
              for sm in range(plan.num_sms)]
    assert sum(per_sm) == 256
    assert max(per_sm) <= 7 and min(per_sm) >= 1, per_sm
