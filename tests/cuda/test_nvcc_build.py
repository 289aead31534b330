"""nvcc builds of the megakernel for sm_90a (no GPU needed): clean ptxas report, cache, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpk.backends.cuda import build, codegen
from mpk.errors import CompileError
from mpk.models.config import get_preset
from mpk.models.prefill import PREFILL_KINDS, PrefillShape, build_prefill_graph
from mpk.tasks.registry import all_kinds
from tests.cuda.runtime_plans import STUB_KINDS, chain_plan

pytestmark = pytest.mark.nvcc
REGISTER_CAP = 255


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mpk-cache")


def assert_clean(result: build.BuildResult, cold_spill_bytes: int = 0,
                 cold_reload_bytes: int | None = None) -> None:
    """No spills (up to `cold_spill_bytes` stored and `cold_reload_bytes`, default twice that,
    reloaded, where a caller says why), registers under the cap."""
    report = result.ptxas()
    spilling = {name: f"{stack} B stack, {stores} B spill stores, {loads} B spill loads"
                for name, (stack, stores, loads) in build.ptxas_functions(result.log).items()
                if stores or loads}
    assert report["spill_stores"] <= cold_spill_bytes, (report, spilling)
    reload = 2 * cold_spill_bytes if cold_reload_bytes is None else cold_reload_bytes
    assert report["spill_loads"] <= reload, (report, spilling)
    assert 0 < report["registers"] <= REGISTER_CAP, report


def test_runtime_compiles_clean_and_caches(cache_root: Path) -> None:
    """The runtime with a stub task: no spills, no stack; the second build compiles nothing."""
    plan = chain_plan(n=256, tiles=4, num_sms=2)
    first = build.build_plan(plan, arch="sm_90a", extra_includes=[STUB_KINDS],
                             cache_root=cache_root)
    assert not first.cached and first.so_path.is_file()
    assert (first.so_path.parent / "nvcc.cmd").read_text().count("compute_90a,code=sm_90a") == 1
    assert_clean(first)
    report = first.ptxas()
    assert report["stack_frame"] == 0, report
    mtime = first.so_path.stat().st_mtime_ns
    second = build.build_plan(plan, arch="sm_90a", extra_includes=[STUB_KINDS],
                              cache_root=cache_root)
    assert second.cached and second.so_path == first.so_path
    assert second.so_path.stat().st_mtime_ns == mtime
    assert second.ptxas() == report


def test_real_task_kernels_compile_clean(cache_root: Path) -> None:
    """Every kind that has an sm90.cuh, in one megakernel, as the runtime will build it. With
    all twelve kinds in one dispatch switch (no model's plan has them all) ptxas keeps a few
    scalars in local memory: the consumer loop's record index, and since the linear kind's
    page-batched MMA walk, five of attention's shared-memory addresses, reloaded once per KV
    chunk (seen in the SASS: 36 B stored); with the three MoE kinds, also a third linear
    operand value, stored and reloaded once per linear task (40 B stored, 44 B loaded; none in
    the MoE code). This allocation is chaotic: other MoE tunings (gate/up pairs per pass, down
    slots per group, router loads in flight) spilled the runtime's slot pointer instead, 112 B
    of reloads at the start of every kind. Since the weight-page cursor keeps its ring slot
    (fourth session): 44 B stored, 112 B reloaded at 28 places; since moe_router takes the
    logits of a spread linear (same session): 60 B stored, 180 B reloaded at 45 places, each
    once per task, per KV chunk or per loop set-up (the consumer loop's index and step, attention
    addresses, linear and moe_router scalars; none inside a weight walk; read off the build's
    SASS); since attention reads a run's earlier rows (fifth session): 84 B stored, 168 B
    reloaded, the new ones attention's context words stored at its entry and reloaded in its
    warp merge, once per task (none in the KV loop); since attention stages its setup before its
    waits (a prologue) and its values through shared memory (eighth session): 80 B stored, 156 B
    reloaded; since linear takes its input as the MMA's A operand, with a walk for each staging
    layout (ninth session): 88 B stored, 164 B reloaded (the new ones in the dispatch set-up,
    none in a weight walk; read off the build's SASS); since every batch size stages its rows
    in one layout (tenth session): 92 B stored, 160 B reloaded (linear's at its task set-up and
    argmax write, once per task; none in a walk); since the rmsnorm input's row sums are
    reduced for all rows at once (twelfth session): 76 B stored, 144 B reloaded; since the MoE
    experts' inner loops are branch-free and moe_down stages row 0 before its ids (thirteenth
    session): 72 B stored, 136 B reloaded; since linear polls flagged inputs and writes its outputs
    in pairs (fourteenth session): 108 B stored, 176 B reloaded; since attention polls a flagged
    qkv and writes a flagged out (fifteenth session): 84 B stored, 236 B reloaded, located with
    `nvdisasm -gi`: attention's prologue set-up (row_setup, the RoPE rows' loop) and its context
    scalars (stored at entry, reloaded at the merge), moe_router's, argmax's and allreduce's
    set-up, once per task each; none in a KV, weight or poll loop; with attention's keys staged
    by cp.async beside its values (sixteenth session): 84 B stored, 224 B reloaded (a version
    that looked up the key rows' masks again reloaded one scalar in the KV loop: 244 B). Since the
    runtime's consumer branch comes first (seventeenth session), ptxas gives the consumers the
    232 registers their setmaxnreg asks for (before, it kept them within the kernel's 168) and
    allocates this build differently: 240 B stored, 448 B reloaded, mostly attention's and the
    runtime's set-up, once per task, but also 4 reloads in attention's tail branch of the KV loop
    (this build only: no model's plan has all these kinds). The plans models compile stay at
    zero at batch 1-8 (test_qwen3_0_6b_megakernel_compiles_clean, the tensor-parallel one, the
    MoE ones; qwen3-8b, llama-3.2-1b and smollm2-135m were checked by hand); at batch 16 a few
    bytes spill in the consumers' loop (the MoE one below; qwen3-0.6b and qwen3-8b b16 12 B
    stored / 12 reloaded since the twenty-eighth session's two chains a wide row). The prefill
    plan's own kinds build in the next test, as the prefill plans combine them."""
    kinds = [k for k in all_kinds() if k not in PREFILL_KINDS]
    missing = codegen.missing_kernels(kinds)
    present = [k for k in kinds if k not in missing]
    if not present:
        pytest.skip(f"no task kernels written yet (missing sm90.cuh: {', '.join(missing)})")
    result = build.compile_source(codegen.render_kinds(present), arch="sm_90a",
                                  cache_root=cache_root)
    assert_clean(result, cold_spill_bytes=240, cold_reload_bytes=448)


def test_prefill_plan_kinds_compile_clean(cache_root: Path) -> None:
    """The kinds of a prefill plan (models/prefill.py), in one megakernel. gemm is inlined
    (its wgmma pipeline must not cross a call: ptxas serialized every wgmma of the out-of-line
    gemm, warning C7510) and the lm_head's linear is called out of line beside it (inlined
    there it spilled ~700 B in the consumers' loop); rope_append and attention_prefill are out
    of line as before. ptxas keeps 184 B stored / 192 B reloaded of the kernel body in local
    memory (the 256-wide tile's 128 accumulators a thread; 444 / 660 while gemm's epilogue went
    through shared memory, thirty-fifth session) and 4-8 B in each out-of-line task but the
    linear's, 64 / 80 (its wide walk keeps two accumulator chains a row, twenty-eighth session;
    a flagged input is polled four vectors a thread in flight, twenty-ninth session: this build
    keeps every kind's flagged paths, a prefill plan's own build folds them away): 256 B stored
    / 272 reloaded in all, with a few bytes' room for the next reshuffle.
    Every model's prefill plan has exactly these kinds."""
    graph = build_prefill_graph(get_preset("tiny-qwen3"), PrefillShape(chunk=64), num_sms=4)
    kinds = sorted({op.kind for op in graph.ops})
    assert set(PREFILL_KINDS) <= set(kinds)
    result = build.compile_source(codegen.render_kinds(kinds), arch="sm_90a",
                                  cache_root=cache_root)
    assert "C7510" not in result.log, "ptxas serialized wgmma (a pipeline crosses a call)"
    assert_clean(result, cold_spill_bytes=264, cold_reload_bytes=288)


def test_broken_source_raises_compile_error(cache_root: Path) -> None:
    with pytest.raises(CompileError) as info:
        build.compile_source("this is not CUDA;\n", arch="sm_90a", cache_root=cache_root)
    message = str(info.value)
    assert "megakernel.cu" in message and str(cache_root) in message
    assert "error" in message.lower()


def test_header_edit_changes_the_build_key(tmp_path: Path) -> None:
    header = tmp_path / "silu_mul" / "sm90.cuh"
    header.parent.mkdir()
    header.write_text("// v1\n")
    source = codegen.render_kinds(["silu_mul"])
    nvcc = build.env.nvcc_path()
    includes = build.include_dirs([tmp_path])
    key1 = build.build_key(source, "sm_90a", includes, (), nvcc)
    assert key1 == build.build_key(source, "sm_90a", includes, (), nvcc)
    header.write_text("// v2\n")
    assert build.build_key(source, "sm_90a", includes, (), nvcc) != key1


@pytest.mark.parametrize("lone", [False, True])
def test_qwen3_0_6b_megakernel_compiles_clean(cache_root: Path, lone: bool) -> None:
    """The megakernel exactly as `mpk generate --model qwen3-0.6b --backend cuda` builds it, and
    the serving engine's one-row plan beside 16 slots (`mpk bench --serving`'s 384 positions):
    its linears and KV splits are the 16-row plan's, one split (no merge by the last split;
    the plain plan has 16 splits and builds it). It also holds the runtime's consumers-first
    branch order: with the producers' branch first, ptxas keeps the consumers within 168
    registers and this plan spills 160 B (seventeenth session)."""
    from mpk.compiler.lower import compile_graph
    from mpk.engine import EngineConfig
    from mpk.models.builder import DecodeShape, build_graph
    from mpk.models.config import get_preset

    shape = EngineConfig(max_seq_len=384).decode_shape(1, 16) if lone else DecodeShape(batch=1)
    plan = compile_graph(build_graph(get_preset("qwen3-0.6b"), shape), 132)
    splits = {op.grid[2] for op in plan.ops if op.kind == "attention"}
    assert (splits == {1}) == lone  # the split plan builds the merge by the last split
    result = build.build_plan(plan, arch="sm_90a", cache_root=cache_root)
    assert_clean(result)
    assert set(plan.kinds) <= set(all_kinds())


@pytest.mark.parametrize(("preset", "batch"), [("tiny-qwen3-moe", 1), ("qwen3-30b-a3b", 1),
                                             ("qwen3-30b-a3b", 16)])
def test_moe_megakernel_compiles_clean(cache_root: Path, preset: str, batch: int) -> None:
    """The Qwen3-MoE plans (router, experts' gate/up and down beside the dense kinds): no
    spills at batch 1; at batch 16 (the linear walk for 9-16 rows built in) 16 B of set-up
    (attention's row set-up, the router's, the runtime's start; seventeenth session's SASS);
    with attention's prologue loading in two round trips 20 B stored / 36 reloaded: a runtime
    loop register stored and reloaded around the prologue, the rest in the runtime's record
    set-up (SASS line info; the b16 step was 5% faster with it all the same: perf-log,
    twenty-seventh session); 36 B / 52 with the linear's prologue in wide plans (the consumers'
    loop around it); 56 / 100 since attention merges its two KV splits itself (thirty-eighth
    session: 52 / 92 of it with the merge compiled out, so mostly the allocation's response to
    one kind less in the dispatch; in the SASS the new ones sit in set-up code, once per task,
    and one reload in a page wait's slow-path spin). Batch 16
    has a larger scratch (SMEM_BYTES) than batch 1."""
    from mpk.compiler.lower import compile_graph
    from mpk.models.builder import DecodeShape, build_graph
    from mpk.models.config import get_preset

    plan = compile_graph(build_graph(get_preset(preset), DecodeShape(batch=batch)), 132)
    assert {"moe_router", "moe_gate_up", "moe_down"} <= set(plan.kinds)
    stored, reloaded = (56, 100) if batch > 8 else (0, 0)
    assert_clean(build.build_plan(plan, arch="sm_90a", cache_root=cache_root), stored, reloaded)


def test_tensor_parallel_megakernel_compiles_clean(cache_root: Path) -> None:
    """Rank 0 of a 2-way tensor-parallel tiny-qwen3, with the cross-GPU all-reduce."""
    from mpk.models.builder import DecodeShape
    from mpk.models.config import get_preset
    from mpk.parallel import rank_plans

    plan = rank_plans(get_preset("tiny-qwen3"), DecodeShape(batch=1), 2, num_sms=132)[0]
    assert "allreduce" in plan.kinds
    result = build.build_plan(plan, arch="sm_90a", cache_root=cache_root)
    assert_clean(result)
