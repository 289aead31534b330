"""nvcc builds of the megakernel, cached by content hash.

Cache layout: env.cache_dir()/<key>/{megakernel.cu, nvcc.cmd, nvcc.log, megakernel.so}, where
key = sha256(source + nvcc flags + `nvcc --version` + every header on the include path)[:20].
Headers are hashed because the source only #includes them: editing a task's sm90.cuh must
rebuild. A file lock per key stops two processes from building the same thing; a second build
of the same inputs compiles nothing.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from mpk import env
from mpk.compiler.plan import Plan
from mpk.errors import CompileError, UnsupportedError
from mpk.tasks.registry import get_kind

from . import codegen

log = logging.getLogger(__name__)

DEFAULT_ARCH = "sm_90a"
BASE_FLAGS = ("-std=c++17", "-O3", "-lineinfo", "-Xptxas", "-v", "--shared", "-Xcompiler", "-fPIC")
HEADER_SUFFIXES = (".cuh", ".h", ".hpp", ".inc")
LOG_TAIL_LINES = 60


@dataclass(frozen=True)
class BuildResult:
    so_path: Path
    source_path: Path
    log_path: Path
    key: str
    cached: bool  # True when nothing was compiled

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def ptxas(self) -> dict[str, int]:
        return ptxas_report(self.log)


# ---- architecture ----------------------------------------------------------------------------
def detect_arch(device: int | None = None) -> str:
    """The nvcc target for the GPU at hand; sm_90a when there is none (CI compile checks)."""
    import torch

    if not torch.cuda.is_available():
        return DEFAULT_ARCH
    major, minor = torch.cuda.get_device_capability(device)
    return arch_for_capability(major, minor)


def arch_for_capability(major: int, minor: int) -> str:
    if major == 9:
        return "sm_90a"  # wgmma/setmaxnreg need the arch-specific 'a' target
    if major < 9:
        raise UnsupportedError(f"GPU compute capability {major}.{minor} is below 9.0: the MPK "
                               f"megakernel needs Hopper (sm_90) or newer")
    raise UnsupportedError(f"GPU compute capability {major}.{minor}: only sm_90 (Hopper) task "
                           f"kernels exist so far (mpk/tasks/<kind>/sm90.cuh)")


def gencode_flags(arch: str) -> list[str]:
    """`-gencode` for an arch like 'sm_90a'. (The `-arch=sm_90a` shorthand can also run a plain
    sm_90 pass that rejects wgmma; the explicit gencode form does not.)"""
    m = re.fullmatch(r"sm_(\d+)([a-z]?)", arch)
    if not m:
        raise UnsupportedError(f"bad CUDA arch {arch!r}; expected e.g. 'sm_90a'")
    num, suffix = m.groups()
    return [f"-gencode=arch=compute_{num}{suffix},code=sm_{num}{suffix}"]


# ---- nvcc ------------------------------------------------------------------------------------
@cache
def nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise CompileError(f"cannot run nvcc ({nvcc!r}): {e}. Install the CUDA toolkit or set "
                           f"MPK_NVCC / CUDA_HOME") from e
    return out.stdout


def include_dirs(extra: Sequence[Path] = ()) -> list[Path]:
    """Include search path: `extra` first (tests, out-of-tree kinds), then csrc/ and mpk/tasks."""
    from mpk.tasks.registry import TASKS_DIR

    return [Path(d).resolve() for d in extra] + [codegen.CSRC_DIR.resolve(), TASKS_DIR.resolve()]


def nvcc_command(nvcc: str, source: Path, output: Path, arch: str, includes: Sequence[Path],
                 extra_flags: Sequence[str] = ()) -> list[str]:
    return [nvcc, *BASE_FLAGS, *gencode_flags(arch), *(f"-I{d}" for d in includes),
            *extra_flags, "-o", str(output), str(source)]


def _headers_digest(includes: Sequence[Path]) -> bytes:
    h = hashlib.sha256()
    for root in includes:
        for path in sorted(p for p in root.rglob("*") if p.suffix in HEADER_SUFFIXES):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.digest()


def build_key(source: str, arch: str, includes: Sequence[Path], extra_flags: Sequence[str],
              nvcc: str) -> str:
    h = hashlib.sha256()
    for part in (source, arch, " ".join([*BASE_FLAGS, *extra_flags]), nvcc_version(nvcc)):
        h.update(part.encode() + b"\0")
    h.update(_headers_digest(includes))
    return h.hexdigest()[:20]


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def _progress(message: str) -> Iterator[None]:
    """A spinner on a terminal, a log line otherwise: nvcc on the megakernel takes a while."""
    log.info("%s", message)
    if sys.stderr.isatty():
        from rich.console import Console

        with Console(stderr=True).status(message):
            yield
    else:
        yield


def compile_source(source: str, *, arch: str | None = None, extra_includes: Sequence[Path] = (),
                   extra_flags: Sequence[str] = (), cache_root: Path | None = None,
                   name: str = "megakernel") -> BuildResult:
    """Compile `source` into a shared library (or return the cached one)."""
    arch = arch or detect_arch()
    nvcc = env.nvcc_path()
    includes = include_dirs(extra_includes)
    key = build_key(source, arch, includes, extra_flags, nvcc)
    root = Path(cache_root) if cache_root is not None else env.cache_dir()
    out_dir = root / key
    result = BuildResult(out_dir / f"{name}.so", out_dir / f"{name}.cu", out_dir / "nvcc.log",
                         key, cached=True)
    with _file_lock(root / f"{key}.lock"):
        if result.so_path.exists():
            return result
        out_dir.mkdir(parents=True, exist_ok=True)
        result.source_path.write_text(source)
        tmp = out_dir / f"{name}.so.tmp"
        cmd = nvcc_command(nvcc, result.source_path, tmp, arch, includes, extra_flags)
        (out_dir / "nvcc.cmd").write_text(" ".join(cmd) + "\n")
        start = time.monotonic()
        with _progress(f"nvcc: compiling the megakernel for {arch} ({result.source_path})"):
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True)
            except OSError as e:
                raise CompileError(f"cannot run nvcc ({nvcc!r}): {e}") from e
        result.log_path.write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-LOG_TAIL_LINES:])
            raise CompileError(f"nvcc failed (exit {proc.returncode}) on {result.source_path}\n"
                               f"command: {out_dir / 'nvcc.cmd'}\nlog tail:\n{tail}")
        os.replace(tmp, result.so_path)
        log.info("nvcc: built %s in %.1f s", result.so_path, time.monotonic() - start)
    return BuildResult(result.so_path, result.source_path, result.log_path, key, cached=False)


def build_plan(plan: Plan, *, arch: str | None = None, extra_includes: Sequence[Path] = (),
               cache_root: Path | None = None, profile: bool = False) -> BuildResult:
    """Render and compile the megakernel for `plan`; a clear error names kinds without code.
    `profile`: the timestamped build (codegen emits MPK_PROFILE into the source, so it has its
    own cache key and never replaces the default build)."""
    missing = codegen.missing_kernels(plan.kinds, extra_includes)
    if missing:
        raise CompileError(f"no CUDA code ({codegen.ARCH_SUFFIX}.cuh) for task kind(s) "
                           f"{', '.join(missing)} used by this plan")
    for index, op in enumerate(plan.ops):
        reason = get_kind(op.kind).cuda_unsupported(plan.op_view(index))
        if reason is not None:
            raise UnsupportedError(f"layer '{op.name}' ({op.kind}): {reason}")
    return compile_source(codegen.render(plan, profile), arch=arch, extra_includes=extra_includes,
                          cache_root=cache_root)


# ---- ptxas -v ---------------------------------------------------------------------------------
_PROPS = re.compile(r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes "
                    r"spill stores, (\d+) bytes spill loads")


def ptxas_functions(log_text: str) -> dict[str, tuple[int, int, int]]:
    """(stack frame, spill stores, spill loads) of every function in the `-Xptxas -v` output, by
    (mangled) name: the place to look when the megakernel spills."""
    return {name: (int(a), int(b), int(c)) for name, a, b, c in _PROPS.findall(log_text)}


def ptxas_report(log_text: str, entry: str = "mpk_megakernel") -> dict[str, int]:
    """Resources of kernel `entry` from the `-Xptxas -v` output: registers, barriers, static
    smem and stack frame of the entry; spill stores/loads summed over the entry AND every
    out-of-line device function (a `__noinline__` task's spills are listed under its own name,
    and they run inside the megakernel all the same). Raises CompileError when the entry is
    not in the log."""
    lines = log_text.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if "Compiling entry function" in line and f"'{entry}'" in line), None)
    if start is None:
        raise CompileError(f"ptxas report for {entry!r} not found in the nvcc log")
    section: list[str] = []
    for line in lines[start + 1:]:
        if "Compiling entry function" in line:
            break
        section.append(line)
    text = "\n".join(section)
    report = {"registers": 0, "spill_stores": 0, "spill_loads": 0, "stack_frame": 0,
              "smem": 0, "barriers": 0}
    for name, stack, stores, loads in _PROPS.findall(text):
        report["spill_stores"] += int(stores)
        report["spill_loads"] += int(loads)
        if name == entry:
            report["stack_frame"] = int(stack)
    if m := re.search(r"Used (\d+) registers", text):
        report["registers"] = int(m.group(1))
    if m := re.search(r"used (\d+) barriers", text):
        report["barriers"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes smem", text):
        report["smem"] = int(m.group(1))
    return report
