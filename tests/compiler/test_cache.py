"""The plan cache: an identical graph loads instead of compiling, anything else recompiles."""

from __future__ import annotations

from pathlib import Path

from mpk.compiler.cache import compile_cached, graph_key
from mpk.compiler.lower import compile_graph
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import get_preset

SHAPE = DecodeShape(batch=2, steps_per_launch=4, page_size=4, max_pages=4, num_pages=8)


def test_second_compile_loads_the_same_plan(tmp_path: Path) -> None:
    graph = build_graph(get_preset("tiny-qwen3"), SHAPE, num_sms=8)
    first = compile_cached(graph, 8, cache_root=tmp_path)
    second = compile_cached(graph, 8, cache_root=tmp_path)
    assert (first.meta["cache"], second.meta["cache"]) == ("miss", "hit")
    assert second.digest() == first.digest() == compile_graph(graph, 8).digest()
    assert second.streams == first.streams and second.constants == first.constants
    assert second.scratch_bytes == first.scratch_bytes


def test_key_changes_with_the_graph_and_sms() -> None:
    cfg = get_preset("tiny-qwen3")
    base = graph_key(build_graph(cfg, SHAPE, num_sms=8), 8)
    assert graph_key(build_graph(cfg, SHAPE, num_sms=8), 8) == base
    assert graph_key(build_graph(cfg, SHAPE, num_sms=8), 16) != base
    other = DecodeShape(batch=1, steps_per_launch=4, page_size=4, max_pages=4, num_pages=8)
    assert graph_key(build_graph(cfg, other, num_sms=8), 8) != base


def test_corrupt_entry_is_recompiled(tmp_path: Path) -> None:
    graph = build_graph(get_preset("tiny-llama"), SHAPE, num_sms=8)
    plan = compile_cached(graph, 8, cache_root=tmp_path)
    (tmp_path / "plans" / graph_key(graph, 8) / "plan.npz").write_bytes(b"garbage")
    again = compile_cached(graph, 8, cache_root=tmp_path)
    assert again.meta["cache"] == "miss" and again.digest() == plan.digest()
