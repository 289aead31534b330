"""The prefill plan (models/prefill.py) on the CPU interpreter: a chunk of prompt positions per
launch through gemm / rope_append / attention_prefill / take_row. Its results do not depend on the order the
tasks run in (so its dependencies are complete); prompts of every length around the chunk size,
several chunks, beside decoding requests, give the reference model's greedy tokens; seeded
sampling draws what the one-position-a-step path draws."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpk.backends.registry import create_executor
from mpk.compiler.lower import compile_graph
from mpk.engine import Engine, SamplingParams
from mpk.errors import UnsupportedError
from mpk.models import decode_io as io
from mpk.models.builder import graph_weights
from mpk.models.config import get_preset
from mpk.models.prefill import (PrefillShape, build_prefill_graph, prefill_segments,
                                supports_prefill)
from mpk.models.reference import ReferenceModel
from mpk.models.weights import random_weights
from mpk.tensors import Role
from mpk.testing import greedy_mismatches

SEED = 77
CHUNK = 32


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(13 * i + 7 * salt + 3) % 250 + 1 for i in range(n)]


@pytest.mark.parametrize(("name", "chunk", "length"), [("tiny-qwen3", CHUNK, 50),
                                                      ("tiny-llama", CHUNK, 50),
                                                      ("tiny-qwen3", 128, 150)])
def test_a_chunk_is_the_same_in_every_task_order(name: str, chunk: int, length: int) -> None:
    """Two chunks of one prompt (the second attends to the first's cached keys; at 128 rows
    each chunk is two query blocks): the caches and the sampled token are bit-identical whether
    tasks run in schedule, random or free (dependency-driven) order; a missing dependency would
    read poison or stale values."""
    cfg = get_preset(name)
    weights = random_weights(cfg, seed=SEED)
    pages = -(-length // 8) + 1
    shape = PrefillShape(chunk=chunk, page_size=8, max_pages=pages, num_pages=pages)
    plan = compile_graph(build_prefill_graph(cfg, shape, num_sms=4), num_sms=4)
    prompt = prompt_of(length)
    results = []
    for order in ("schedule", "random", "free"):
        ex = create_executor(plan, "cpu", poison=True, order=order, seed=SEED)
        _bind(ex, plan, cfg, shape, weights)
        for start, n in ((0, chunk), (chunk, len(prompt) - chunk)):
            ids = torch.zeros(1, chunk, dtype=torch.int32)
            ids[0, :n] = torch.tensor(prompt[start: start + n])
            for key, value in ((io.PROMPT, ids), (io.POSITIONS, [start]), (io.CHUNK, [n]),
                               (io.HEAD_POSITION, [start + n - 1])):
                ex.write(key, torch.as_tensor(value, dtype=torch.int32))
            ex.run(1)
        results.append([ex.read(io.TOKENS_OUT)] +
                       [ex.read(io.k_cache(l)) for l in range(cfg.num_layers)])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def _bind(ex, plan, cfg, shape: PrefillShape, weights: dict) -> None:
    """The graph's weights, noise-filled caches and a shuffled page table (fixed seed)."""
    gen = torch.Generator().manual_seed(SEED)
    prepared = graph_weights(cfg, weights, shape.max_seq_len)
    for t in plan.tensors:
        if t.role == "weight":
            ex.bind(t.name, prepared[t.name])
        elif t.name.startswith(("k_cache", "v_cache")):
            ex.bind(t.name, torch.randn(t.shape, generator=gen).bfloat16())
        elif t.name == io.PAGE_TABLE:
            ex.bind(t.name, torch.randperm(shape.num_pages, generator=gen).int()[None])
        elif t.role == "io":
            ex.bind(t.name, torch.zeros(t.shape, dtype=torch.int32))


def engine_for(name: str, **opts) -> tuple[Engine, object, dict]:
    cfg = get_preset(name)
    weights = random_weights(cfg, seed=SEED)
    engine = Engine(cfg, weights, backend="cpu", num_sms=4, max_seq_len=160,
                    steps_per_launch=4, progress=False, **{"prefill_chunk": CHUNK, **opts})
    return engine, cfg, weights


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_prompts_around_the_chunk_size_match_the_reference(name: str) -> None:
    engine, cfg, weights = engine_for(name)
    prompts = [prompt_of(n, salt=n) for n in (5, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7)]
    result = engine.generate(prompts, max_new_tokens=6)
    bad = greedy_mismatches(ReferenceModel(cfg, weights, max_seq=160), prompts,
                            result.token_ids)
    assert not bad, "; ".join(bad)
    # the longest prompt: 4 chunks, each alternating with a launch of the other rows
    assert result.timings["launches"] < 20


def test_chunks_alternate_with_the_decoding_requests() -> None:
    engine, cfg, weights = engine_for("tiny-qwen3")
    engine.start(max_batch=3)
    try:
        short = engine.submit([5, 17, 2], SamplingParams(max_tokens=24))
        next(iter(short))
        long = engine.submit(prompt_of(120, 1), SamplingParams(max_tokens=5))
        got = [short.result(timeout=300).token_ids, long.result(timeout=300).token_ids]
        stats = engine.scheduler.stats
        free = engine.scheduler.pool.num_free
    finally:
        engine.stop()
    bad = greedy_mismatches(ReferenceModel(cfg, weights, max_seq=160),
                            [[5, 17, 2], prompt_of(120, 1)], got)
    assert not bad, "; ".join(bad)
    assert stats.steps < 60  # 4 chunk launches instead of 120 steps
    assert free == engine._runners[3].cache.pool.num_pages  # every page came back


def test_seeded_sampling_matches_the_one_position_path() -> None:
    """Equal here, not in general: the paths round alike up to the matmuls' summation order
    (which depends on the row count), and this fixed-seed case is far from a flip."""
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=99)
    prompt = prompt_of(70, 2)
    slow, _, _ = engine_for("tiny-qwen3", prefill_chunk=0, prefill_rows=1)
    fast, _, _ = engine_for("tiny-qwen3")
    a = slow.generate([prompt], max_new_tokens=8, sampling=params)
    b = fast.generate([prompt], max_new_tokens=8, sampling=params)
    assert a.token_ids == b.token_ids
    assert a.timings["steps"] == 70 + 7 and b.timings["steps"] < 15
    assert slow.prefill_chunk == 0 and fast.prefill_chunk == CHUNK


def test_which_backends_and_models_take_prefill_plans() -> None:
    assert supports_prefill(get_preset("tiny-llama"), "cpu")
    assert not supports_prefill(get_preset("tiny-qwen3-moe"), "cpu")  # MoE: runs
    assert supports_prefill(get_preset("tiny-llama"), "cuda")
    # attention_prefill's CUDA tile holds head dims up to 128 in registers
    wide_heads = dataclasses.replace(get_preset("tiny-llama"), head_dim=256)
    assert supports_prefill(wide_heads, "cpu") and not supports_prefill(wide_heads, "cuda")
    # the gemm kind's rows are whole 16-byte groups: other widths feed prompts as runs
    odd = dataclasses.replace(get_preset("tiny-llama"), intermediate_size=164)
    assert not supports_prefill(odd, "cpu") and not supports_prefill(odd, "cuda")


def test_chunks_of_two_query_blocks_match_the_reference() -> None:
    engine, cfg, weights = engine_for("tiny-qwen3", prefill_chunk=128)
    prompt = prompt_of(150, 3)  # 128 + 22: rows past 64 in the first chunk's second block
    result = engine.generate([prompt], max_new_tokens=6)
    bad = greedy_mismatches(ReferenceModel(cfg, weights, max_seq=160), [prompt],
                            result.token_ids)
    assert not bad, "; ".join(bad)
    assert result.timings["launches"] <= 4


def test_the_plans_of_an_engine_share_one_fp32_copy_of_the_weights() -> None:
    """The interpreter keeps an fp32 copy of each bf16 weight; the decode and prefill plans of
    one engine bind the same weights, so they share the copies (no second model in memory)."""
    engine, cfg, weights = engine_for("tiny-llama")
    engine.generate([prompt_of(70)], max_new_tokens=2)  # builds the prefill plan
    runner = engine._runners[1]
    assert runner.chunk is not None
    for name in ("layers.0.qkv_weight", "embed"):
        assert runner.executor.tensors[name].data_ptr() == runner.chunk.tensors[name].data_ptr()


def _launch(ex, chunk: int, pieces: list[tuple[list[int], int, int]], segments: int) -> None:
    """One launch of `pieces` (tokens, first position, first row) on a plan of `segments`."""
    ids = torch.zeros(1, chunk, dtype=torch.int32)
    positions, lengths, starts = [0] * segments, [0] * segments, [chunk - 1] * segments
    for s, (tokens, p0, row) in enumerate(pieces):
        ids[0, row: row + len(tokens)] = torch.tensor(tokens)
        positions[s], lengths[s], starts[s] = p0, len(tokens), row
    values = {io.PROMPT: ids, io.POSITIONS: positions, io.CHUNK: lengths,
              io.HEAD_POSITION: [p + max(n, 1) - 1 for p, n in zip(positions, lengths)]}
    if segments > 1:
        values[io.STARTS] = starts
    for key, value in values.items():
        ex.write(key, torch.as_tensor(value, dtype=torch.int32))
    ex.run(1)


def test_a_packed_chunk_computes_each_sequence_as_its_own_launch() -> None:
    """Three sequences in one 256-row chunk (segments from rows 0, 64 and 192; one continues
    after 40 cached positions), in free task order with poisoned buffers: each segment's token
    and keys equal those of the sequence run alone through the one-segment plan."""
    cfg = get_preset("tiny-qwen3")
    weights = random_weights(cfg, seed=SEED)
    chunk, per_seq = 256, 16
    prompts = [prompt_of(50, 1), prompt_of(70, 2), prompt_of(20, 3)]
    gen = torch.Generator().manual_seed(SEED)
    tables = torch.randperm(3 * per_seq, generator=gen).int().reshape(3, per_seq)
    noise = {f: torch.randn((3 * per_seq, 8, cfg.num_kv_heads, cfg.head_dim), generator=gen)
             .bfloat16() for f in ("k", "v")}

    def executor(segments: int):
        shape = PrefillShape(chunk=chunk, page_size=8, max_pages=per_seq,
                             num_pages=3 * per_seq, segments=segments)
        plan = compile_graph(build_prefill_graph(cfg, shape, num_sms=4), num_sms=4)
        ex = create_executor(plan, "cpu", poison=True, order="free", seed=SEED)
        prepared = graph_weights(cfg, weights, shape.max_seq_len)
        for t in plan.tensors:
            if t.role == "weight":
                ex.bind(t.name, prepared[t.name])
            elif t.name.startswith(("k_cache", "v_cache")):
                ex.bind(t.name, noise[t.name[0]].clone())
            elif t.role == "io":
                ex.bind(t.name, torch.zeros(t.shape, dtype=torch.int32))
        return ex

    packed = executor(3)
    packed.write(io.PAGE_TABLE, tables[[1, 0, 2]])  # segment 0 holds sequence 1 at first
    _launch(packed, chunk, [(prompts[1][:40], 0, 0)], 3)
    packed.write(io.PAGE_TABLE, tables)
    _launch(packed, chunk, [(prompts[0], 0, 0), (prompts[1][40:], 40, 64), (prompts[2], 0, 192)],
            3)
    tokens = packed.read(io.TOKENS_OUT)[0].tolist()
    for seq, prompt in enumerate(prompts):
        alone = executor(1)
        alone.write(io.PAGE_TABLE, tables[seq: seq + 1])
        cuts = [(0, 40), (40, 70)] if seq == 1 else [(0, len(prompt))]
        for lo, hi in cuts:
            _launch(alone, chunk, [(prompt[lo:hi], lo, 0)], 1)
        assert tokens[seq] == int(alone.read(io.TOKENS_OUT)[0, 0]), f"sequence {seq}"
        for layer in range(cfg.num_layers):
            pages = tables[seq].long()
            for name in (io.k_cache(layer), io.v_cache(layer)):
                assert torch.equal(packed.read(name)[pages], alone.read(name)[pages]), \
                    f"sequence {seq}, {name}"


def test_the_cuda_build_refuses_packed_chunks() -> None:
    """The CUDA prefill kernels read one segment: a plan of several is refused before nvcc, with
    the layer named, never compiled into wrong answers."""
    from mpk.backends.cuda import build

    shape = PrefillShape(chunk=128, page_size=8, max_pages=4, num_pages=8, segments=2)
    plan = compile_graph(build_prefill_graph(get_preset("tiny-qwen3"), shape, num_sms=4),
                         num_sms=4)
    with pytest.raises(UnsupportedError, match=r"layer 'layers\.0\.rope_append' .*one sequence"):
        build.build_plan(plan, arch="sm_90a")
    with pytest.raises(UnsupportedError, match="at least as many 64-row blocks"):
        PrefillShape(chunk=96, segments=2)


def test_the_cuda_build_refuses_a_rope_table_that_is_not_a_weight() -> None:
    """rope_append's kernel reads the RoPE table through L1, which only a tensor nothing writes
    during the launch allows: a table bound as an IO tensor is refused before nvcc."""
    from mpk.backends.cuda import build

    graph = build_prefill_graph(get_preset("tiny-qwen3"), PrefillShape(chunk=64), num_sms=4)
    rope = graph.tensors["rope"]
    graph.tensors["rope"] = dataclasses.replace(rope, role=Role.IO)
    plan = compile_graph(graph, num_sms=4)
    with pytest.raises(UnsupportedError, match=r"rope_append.*RoPE table must be a weight"):
        build.build_plan(plan, arch="sm_90a")


def test_prompts_packed_into_chunk_launches_match_the_reference(monkeypatch) -> None:
    """A 128-row chunk packs two prompts (one a 64-row block each; a longer one alone): five
    prompts at once give the reference model's greedy tokens, and launches did hold two."""
    from mpk.engine.scheduler import Scheduler

    packed: list[int] = []
    launch = Scheduler._chunk_launch

    def spy(self, pieces):
        packed.append(len(pieces))
        return launch(self, pieces)

    monkeypatch.setattr(Scheduler, "_chunk_launch", spy)
    engine, cfg, weights = engine_for("tiny-qwen3", prefill_chunk=128)
    prompts = [prompt_of(n, salt=n) for n in (40, 21, 60, 130, 9)]
    result = engine.generate(prompts, max_new_tokens=5)
    bad = greedy_mismatches(ReferenceModel(cfg, weights, max_seq=160), prompts,
                            result.token_ids)
    assert not bad, "; ".join(bad)
    assert engine._segments(len(prompts)) == 2 and max(packed) == 2
    assert prefill_segments("cuda", 128, 16) == 1 and prefill_segments("cpu", 96, 16) == 1
