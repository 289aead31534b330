"""The profiling hooks of the CUDA backend: one macro apart from the default build, its own cache
key, the Params mirror in sync with runtime.cuh; with nvcc, a clean sm_90a profiling build."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mpk.backends.cuda import build, codegen
from mpk.backends.cuda.loader import Megakernel, Params
from mpk.compiler.plan import Plan
from mpk.errors import CompileError
from tests.profile.synthetic import tiny_plan

MACRO = "#define MPK_PROFILE 1"


def test_profile_build_differs_by_the_macro_only(plan: Plan) -> None:
    default, profiled = codegen.render(plan), codegen.render(plan, profile=True)
    assert MACRO in profiled and MACRO not in default and "#ifdef MPK_PROFILE" not in default
    assert profiled.replace(codegen.options_block(True), codegen.options_block(False)) == default
    assert profiled.index(MACRO) < profiled.index('#include "runtime.cuh"')
    for name, value in codegen.PROFILE_STAMPS.items():
        assert f"inline constexpr int PROF_{name} = {value};" in default
    assert f"inline constexpr int PROF_STAMPS = {len(codegen.PROFILE_STAMPS)};" in default
    nvcc = build.env.nvcc_path()
    includes = build.include_dirs()
    try:
        keys = {build.build_key(src, "sm_90a", includes, (), nvcc) for src in (default, profiled)}
    except CompileError:  # no nvcc here: the key includes `nvcc --version`
        pytest.skip("nvcc not available for the build key")
    assert len(keys) == 2


def test_params_mirror_matches_runtime_cuh() -> None:
    """loader.Params must list mpk::Params' fields in order (the size check at load time only
    catches a size change); the tensor-parallel fields come after the profile pointer."""
    source = (codegen.CSRC_DIR / "params.cuh").read_text()
    body = re.search(r"struct Params \{(.*?)\};", source, re.DOTALL).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = [re.findall(r"(\w+)\s*$", decl.strip())[0] for decl in body.split(";")
              if decl.strip()]
    assert fields == [name for name, _ in Params._fields_]
    assert fields[-5:] == ["profile", "peer_arenas", "xflags_offset", "rank", "ranks"]
    assert Params.profile.offset == 88
    assert codegen.ABI_VERSION >= 3


@pytest.mark.nvcc
def test_profiling_build_compiles_clean_for_sm90a(tmp_path: Path) -> None:
    plan = tiny_plan()
    result = build.build_plan(plan, arch="sm_90a", cache_root=tmp_path, profile=True)
    assert MACRO in result.source_path.read_text()
    report = result.ptxas()
    spilling = {name: (stack, stores, loads)
                for name, (stack, stores, loads) in build.ptxas_functions(result.log).items()
                if stores or loads}
    # Since the runtime's consumer branch comes first (seventeenth session), ptxas keeps 8 B of
    # report_failure (the out-of-line error report, run at most once a launch) in local memory
    # in this build, and the kernel an 8 B frame for that call; the kernel spills nothing.
    for name, (_, stores, loads) in spilling.items():
        allowed = 8 if "report_failure" in name else 0
        assert stores <= allowed and loads <= allowed, (report, spilling)
    kernel_stack = build.ptxas_functions(result.log)["mpk_megakernel"][0]
    assert kernel_stack <= 8 and 0 < report["registers"] <= 255, report
    # The library loads without a GPU: the ABI matches and it reports itself as profiling.
    assert Megakernel(result.so_path).profiling
    again = build.build_plan(plan, arch="sm_90a", cache_root=tmp_path, profile=True)
    assert again.cached and again.key == result.key
