"""CPU-only checks of the megakernel code generator and the build helpers (no nvcc, no GPU)."""

from __future__ import annotations

import ctypes
import re

import pytest

from mpk.backends.cuda import build, codegen
from mpk.backends.cuda.loader import Params
from mpk.compiler import record
from mpk.compiler.lower import compile_graph
from mpk.compiler.plan import Plan
from mpk.dtypes import DType
from mpk.errors import CompileError, UnsupportedError
from mpk.graph.graph import Graph
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import get_preset
from mpk.tasks.registry import all_kinds, get_kind
from mpk.tensors import Role
from mpk.testing import cuda_constants
from tests.cuda.runtime_plans import chain_plan


def small_plan(num_sms: int = 4) -> Plan:
    """rmsnorm -> linear, unfused, so the plan uses exactly two kinds."""
    g = Graph()
    x = g.add_tensor("x", (1, 64), DType.BF16, Role.IO)
    w = g.add_tensor("w", (64,), DType.BF16, Role.WEIGHT)
    h = g.add_tensor("h", (1, 64), DType.BF16, Role.ACTIVATION)
    big_w = g.add_tensor("W", (128, 64), DType.BF16, Role.WEIGHT)
    y = g.add_tensor("y", (1, 128), DType.BF16, Role.IO)
    g.add_op("rmsnorm", "norm", (1,), {"x": x, "weight": w, "out": h})
    g.add_op("linear", "proj", (4,), {"x": h, "weight": big_w, "out": y})
    return compile_graph(g, num_sms=num_sms, fuse_ops=False)


def namespace(source: str, kind: str) -> str:
    m = re.search(rf"namespace mpk::kinds::{kind} \{{(.*?)\}}  // namespace", source, re.S)
    assert m, f"no namespace block for {kind}"
    return m.group(1)


def test_layout_constants_come_from_record() -> None:
    src = codegen.render(small_plan())
    consts = cuda_constants(src)
    for name, value in record.layout_constants().items():
        assert consts[f"REC_{name}"] == value, name
    assert consts["NUM_THREADS"] == 256
    plan = small_plan()
    assert plan.scratch_bytes == 16 * 1024
    assert consts["PAGE_BYTES"] == 16 * 1024 and consts["NUM_PAGES"] == codegen.MAX_PAGES
    # A task gets what the pages leave: at least the plan's scratch, all of shared memory used.
    assert consts["SMEM_BYTES"] == codegen.task_scratch_bytes(plan.scratch_bytes) >= \
        plan.scratch_bytes
    assert consts["DYN_SMEM_BYTES"] == consts["NUM_PAGES"] * consts["PAGE_BYTES"] + \
        consts["SMEM_BYTES"] == codegen.dynamic_smem_bytes(plan.scratch_bytes)
    assert consts["DYN_SMEM_BYTES"] + codegen.STATIC_RESERVE == codegen.SMEM_LIMIT
    assert consts["PARAM_WORDS"] == record.PARAM_WORDS
    assert consts["MPK_ABI_VERSION"] == codegen.ABI_VERSION
    assert consts["ERR_WORDS"] == codegen.ERROR_WORDS
    for name, value in codegen.ERROR_FIELDS.items():
        assert consts[f"ERR_{name}"] == value
    assert max(codegen.ERROR_FIELDS.values()) < codegen.ERROR_WORDS
    assert consts["SMS_WORDS"] == codegen.SM_STATE_WORDS
    for name, value in codegen.SM_STATE_FIELDS.items():
        assert consts[f"SMS_{name}"] == value
    assert "@@" not in src


def test_kinds_dispatch_and_includes_follow_the_plan() -> None:
    plan = small_plan()
    src = codegen.render(plan)
    assert plan.kinds == ("linear", "rmsnorm")
    for kind_id, name in enumerate(plan.kinds):
        kind = get_kind(name)
        block = cuda_constants(namespace(src, name))
        assert block["KIND_ID"] == kind_id
        for slot, spec in enumerate(kind.operands):
            assert block[f"O_{spec.name.upper()}"] == slot
        for index, param in enumerate(kind.params):
            assert block[f"P_{param.name.upper()}"] == index
        assert f'#include "{name}/sm90.cuh"' in src
        assert re.search(rf"case {kind_id}:\s*mpk::kinds::{name}::run\(a\);\s*break;", src)
    prologues = sum(1 for name in plan.kinds if get_kind(name).prologue_operands)
    assert len(re.findall(r"case \d+:", src)) == len(plan.kinds) + prologues
    assert 'MPK_KIND_NAMES[] = {"linear", "rmsnorm", nullptr}' in src
    # Kinds the plan does not use are neither included nor dispatched.
    for name in set(all_kinds()) - set(plan.kinds):
        assert f'"{name}/sm90.cuh"' not in src
        assert f"mpk::kinds::{name}" not in src
    # The constants are defined before the kernels that use them, the runtime comes last.
    assert src.index("REC_WORDS") < src.index("task_args.cuh") < src.index('"linear/sm90.cuh"')
    assert src.index("bool dispatch") < src.index('#include "runtime.cuh"')


def test_source_depends_only_on_kinds_and_sizes() -> None:
    assert codegen.render(small_plan(4)) == codegen.render(small_plan(7))
    chain = chain_plan(n=256, tiles=4, num_sms=2)
    assert codegen.render(chain) == codegen.render_kinds(["silu_mul"],
                                                         flagged=codegen.flagged_kinds(chain))
    with pytest.raises(CompileError, match="duplicate"):
        codegen.render_kinds(["rmsnorm", "rmsnorm"])
    # A larger task scratch leaves fewer weight pages; too large a one is refused clearly.
    big = cuda_constants(codegen.render_kinds(["silu_mul"], scratch_bytes=96 * 1024))
    assert big["NUM_PAGES"] == (codegen.SMEM_LIMIT - codegen.STATIC_RESERVE - 96 * 1024) // \
        codegen.PAGE_BYTES < codegen.MAX_PAGES
    with pytest.raises(UnsupportedError, match="weight pages"):
        codegen.render_kinds(["silu_mul"], scratch_bytes=200 * 1024)


def flagged_constant(source: str, kind: str) -> bool:
    m = re.search(r"constexpr bool FLAGGED = (true|false);", namespace(source, kind))
    assert m, f"no FLAGGED in {kind}"
    return m.group(1) == "true"


@pytest.mark.parametrize(("preset", "batch", "expected"), [
    ("tiny-qwen3", 1, {"attention", "embedding", "linear"}),
    ("qwen3-0.6b", 16, {"embedding", "linear"}), ("qwen3-8b", 16, set())])
def test_flagged_follows_the_plans_flagged_tensors(preset: str, batch: int,
                                                   expected: set[str]) -> None:
    # Without a plan every kind keeps its flagged paths; a plan folds them away in the kinds
    # none of whose ops touches a flagged tensor (common/flags.cuh flag_epoch): qwen3-8b's
    # activations at batch 16 are all above the flag size limit (qwen3-0.6b's hidden stream is
    # under it).
    assert flagged_constant(codegen.render_kinds(["linear"]), "linear")
    plan = compile_graph(build_graph(get_preset(preset), DecodeShape(batch=batch)), 132)
    flagged = {op.kind for op in plan.ops for _, tid in op.operands if plan.tensors[tid].flagged}
    assert flagged == expected
    assert codegen.flagged_kinds(plan) == flagged
    src = codegen.render(plan)
    for name in plan.kinds:
        assert flagged_constant(src, name) is (name in flagged)


@pytest.mark.parametrize(("batch", "vectors"), [(1, 2), (8, 4)])
def test_linear_polls_as_many_vectors_a_thread_as_its_largest_flagged_input(batch: int,
                                                                            vectors: int) -> None:
    # qwen3-0.6b b1: act (3072 bf16, 384 vectors) is the largest flagged x: two a thread in
    # flight; b8: hidden (8 x 1024, 1024 vectors) four.
    plan = compile_graph(build_graph(get_preset("qwen3-0.6b"), DecodeShape(batch=batch)), 132)
    assert dict(plan.constants)["LINEAR_POLL_VECS"] == vectors
    assert cuda_constants(codegen.render(plan))["LINEAR_POLL_VECS"] == vectors


def test_plan_constants_raise_kind_defaults() -> None:
    src = codegen.render_kinds(["attention"])
    assert cuda_constants(src)["ATTN_MAX_HEAD_DIM"] == 128
    src = codegen.render_kinds(["attention"], constants={"ATTN_MAX_HEAD_DIM": 256})
    assert cuda_constants(src)["ATTN_MAX_HEAD_DIM"] == 256


def test_beside_a_wgmma_pipeline_linear_is_called_out_of_line() -> None:
    """gemm's wgmma pipeline must not cross a call (ptxas serializes it: C7510), so gemm is
    dispatched inline; linear, which crowded it there, goes through its __noinline__ wrapper,
    and only in plans that hold a wgmma_pipeline kind."""
    alone = codegen.render_kinds(["linear", "rmsnorm"])
    assert "run_outlined" not in alone
    beside = codegen.render_kinds(["gemm", "linear", "rmsnorm"])
    assert re.search(r"case 0:\s*mpk::kinds::gemm::run\(a\);", beside)
    assert re.search(r"case 1:\s*mpk::kinds::linear::run_outlined\(a\);", beside)
    assert re.search(r"case 2:\s*mpk::kinds::rmsnorm::run\(a\);", beside)
    assert re.search(r'#include "linear/sm90.cuh"\s*namespace mpk::kinds::linear \{\s*'
                     r"__device__ __noinline__ void run_outlined", beside)
    assert codegen.outlined(["gemm", "linear", "rmsnorm"]) == {"linear"}


def test_prefill_attention_stages_rows_at_its_plans_head_dim() -> None:
    for d, width in ((64, 64), (80, 128), (128, 128)):
        g = Graph()
        g.add_tensor("q", (64, 2 * d), DType.BF16, Role.ACTIVATION)
        g.add_tensor("out", (64, 2 * d), DType.BF16, Role.ACTIVATION)
        g.add_tensor("rope", (256, d), DType.F32, Role.WEIGHT)
        for name, shape in (("positions", (1,)), ("chunk", (1,)), ("page_table", (1, 8))):
            g.add_tensor(name, shape, DType.I32, Role.IO)
        for name in ("k_cache", "v_cache"):
            g.add_tensor(name, (8, 16, 1, d), DType.BF16, Role.IO)
        g.add_op("attention_prefill", "attn", (1, 2), {n: n for n in (
            "q", "out", "rope", "positions", "chunk", "page_table", "k_cache", "v_cache")})
        plan = compile_graph(g, num_sms=4)
        assert dict(plan.constants)["PREFILL_HEAD_DIM"] == width
        assert cuda_constants(codegen.render(plan))["PREFILL_HEAD_DIM"] == width


def test_params_struct_layout() -> None:
    # mpk::Params: 8 pointers, then step_begin, num_steps, max_len, timeout_ns, profile, then the
    # tensor-parallel peer_arenas, xflags_offset, rank, ranks (x86-64 / aarch64).
    assert ctypes.sizeof(Params) == 120
    assert Params.step_begin.offset == 64 and Params.timeout_ns.offset == 80
    assert Params.profile.offset == 88 and Params.peer_arenas.offset == 96
    assert Params.xflags_offset.offset == 104 and Params.rank.offset == 112
    assert Params.ranks.offset == 116


def test_arch_selection() -> None:
    assert build.arch_for_capability(9, 0) == "sm_90a"
    assert build.gencode_flags("sm_90a") == ["-gencode=arch=compute_90a,code=sm_90a"]
    with pytest.raises(UnsupportedError, match="below 9.0"):
        build.arch_for_capability(8, 0)
    with pytest.raises(UnsupportedError):
        build.gencode_flags("hopper")


def test_ptxas_report_parses_the_entry() -> None:
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'mpk_megakernel' for 'sm_90a'
ptxas info    : Function properties for mpk_megakernel
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 16 bytes cumulative stack size, 1284 bytes smem
ptxas info    : Compile time = 88.038 ms
ptxas info    : Function properties for _ZN3mpk14report_failureEPiS0_iiPKiiiyyx
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Function properties for _ZN3mpk5kinds6linear3runERKNS_8TaskArgsE
    0 bytes stack frame, 640 bytes spill stores, 1000 bytes spill loads
"""
    # Spills of out-of-line device functions (here a __noinline__ task) count too.
    assert build.ptxas_report(log) == {"registers": 168, "spill_stores": 648, "spill_loads": 1004,
                                       "stack_frame": 16, "smem": 1284, "barriers": 1}
    with pytest.raises(CompileError, match="not found"):
        build.ptxas_report("nothing here")
