"""Renders the megakernel source for a Plan from csrc/megakernel.cu.in.

The template has five holes, all filled from data, never from hand-kept lists:
  OPTIONS    `#define MPK_PROFILE 1` in the profiling build (per-record timer stamps), else a
             comment: the macro is the only difference between the two builds; and
             `#define MPK_TASK_PARAMS 1` when a kind reads the launch's Params (TaskArgs::p);
  CONSTANTS  record layout (record.layout_constants() as REC_<NAME>), runtime sizes (the page
             ring follows from Plan.scratch_bytes, the task scratch is what the pages leave:
             task_scratch_bytes), the error buffer layout
             (ERROR_FIELDS below, shared with the executor), the SAMPLING and RUNS row
             layouts (tasks/sampling.py, tasks/runs.py) and the ABI version;
  KINDS      for each kind of the plan (kind id = index in plan.kinds): its operand slots
             O_<OPERAND>, param indices P_<PARAM> and FLAGGED (does an op of the kind access a
             flagged tensor in this plan) in `namespace mpk::kinds::<kind>`, then
             `#include "<kind>/sm90.cuh"` (resolved against mpk/tasks);
  DISPATCH   `case <kind id>: mpk::kinds::<kind>::run(a); break;` (`run_outlined`, a
             __noinline__ wrapper of run in the kind's block, for the kinds `outlined` says);
  KIND_NAMES the kind-name table for profilers and error messages.
The rendered source depends only on the plan's kinds (in order), its page count, constants,
flagged kinds and the profiling flag, not on its tables, so one build serves every plan that
shares them.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

from mpk.compiler import record
from mpk.compiler.plan import Plan
from mpk.errors import CompileError, UnsupportedError
from mpk.tasks import base, runs, sampling
from mpk.tasks.registry import get_kind

CSRC_DIR = Path(__file__).parent / "csrc"
TEMPLATE = CSRC_DIR / "megakernel.cu.in"

# Bump when Params, the error buffer or the exported host functions change meaning.
ABI_VERSION = 5  # 2: Params.profile; 3: tensor-parallel peers; 4: warp roles, weight pages;
# 5: flagged activations (record POLLED, the params' flag entries)
NUM_THREADS = base.TASK_THREADS  # what a task runs on (the runtime adds a producer warpgroup)
RUNTIME_THREADS = NUM_THREADS + 128
PAGE_BYTES = base.PAGE_BYTES
MAX_PAGES = 12
MIN_PAGES = 4
SMEM_LIMIT = 227 * 1024  # shared memory one CTA may have on sm_90 (static + dynamic)
STATIC_RESERVE = 8 * 1024  # the runtime's static shared memory (record ring, barriers), bounded
ARCH_SUFFIX = "sm90"  # which <kind>/<arch>.cuh the kinds are included from

# The error buffer (int32 words) the runtime fills when it stops: emitted as ERR_<NAME>.
ERROR_FIELDS: dict[str, int] = {
    "CODE": 0,  # 0 = no error, else one of ERROR_CODES
    "SM": 1,
    "TASK": 2,
    "KIND": 3,
    "INDEX": 4,  # position of the record in its SM's list
    "COUNTER": 5,
    "VALUE_LO": 6,
    "VALUE_HI": 7,
    "TARGET_LO": 8,
    "TARGET_HI": 9,
    "STEP_LO": 10,  # global step
    "STEP_HI": 11,
}
ERROR_WORDS = 16
# PEER_TIMEOUT: an all-reduce waited too long for a peer GPU's partial (COUNTER = the peer rank).
ERROR_CODES: dict[str, int] = {"TIMEOUT": 1, "BAD_KIND": 2, "PEER_TIMEOUT": 3, "POLL_TIMEOUT": 4}

# Per-SM stop state [num_sms, SM_STATE_WORDS] (emitted as SMS_<NAME>): where each CTA stopped
# after a failure. STATUS stays 0 for a CTA that finished its list (or never stopped).
SM_STATE_FIELDS: dict[str, int] = {"STATUS": 0, "INDEX": 1, "STEP": 2, "WAIT": 3}
SM_STATE_WORDS = 4
# PEER: stopped after a task that waits on its own (the tensor-parallel all-reduce's peer wait)
# saw the launch stop.
SM_STATUS: dict[str, int] = {"WAITING": 1, "BAD_KIND": 2, "PEER": 3, "POLL": 4}

# The per-record timer stamps of a profiling build (emitted as PROF_<NAME>, PROF_STAMPS): the
# runtime writes profile[step][sm][index][stamp] with these stamp indices.
PROFILE_STAMPS: dict[str, int] = {
    "WAIT": 0,  # the consumer warps are free for the record (they finished the previous one)
    "RUN": 1,  # the consumers saw it ready: the task starts
    "END": 2,  # the task ran, the storer fenced and issued its signals
    "READY": 3,  # the controller saw the record's counters met (<= RUN)
    "INPUT": 4,  # a kind's mark 0 (linear: input staged and normalised); 0 when not marked
    "COMPUTE": 5,  # a kind's mark 1 (linear: its last block's weight walk done); 0 when not marked
    "DONE": 6,  # every consumer warp left the task (the storer's turn)
}

_HOLE = re.compile(r"@@([A-Z_]+)@@")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def num_pages(scratch_bytes: int) -> int:
    """Weight pages the runtime keeps next to a task scratch of `scratch_bytes`."""
    pages = min(MAX_PAGES, (SMEM_LIMIT - STATIC_RESERVE - scratch_bytes) // PAGE_BYTES)
    if pages < MIN_PAGES:
        raise UnsupportedError(
            f"a task of this plan needs {scratch_bytes // 1024} KB of shared memory, which "
            f"leaves room for only {max(pages, 0)} weight pages (the runtime needs "
            f"{MIN_PAGES}); use a smaller batch")
    return pages


def task_scratch_bytes(scratch_bytes: int) -> int:
    """The scratch a task gets next to a plan's `scratch_bytes` (at least that): whatever the
    weight pages leave, so that plans with the same page count share one build (SMEM_BYTES)."""
    return SMEM_LIMIT - STATIC_RESERVE - num_pages(scratch_bytes) * PAGE_BYTES


def dynamic_smem_bytes(scratch_bytes: int) -> int:
    """The runtime's dynamic shared memory: the weight pages, then the task scratch."""
    return num_pages(scratch_bytes) * PAGE_BYTES + task_scratch_bytes(scratch_bytes)


def constants_block(scratch_bytes: int = 16 * 1024) -> str:
    """C++ constants shared by the runtime and the tasks (`inline` so unused ones don't warn)."""
    pages = num_pages(scratch_bytes)
    scratch_bytes = task_scratch_bytes(scratch_bytes)
    lines = [f"inline constexpr int REC_{name} = {value};"
             for name, value in sorted(record.layout_constants().items())]
    lines += [
        f"inline constexpr int NUM_THREADS = {NUM_THREADS};",
        f"inline constexpr int SMEM_BYTES = {scratch_bytes};",
        f"inline constexpr int PAGE_BYTES = {PAGE_BYTES};",
        f"inline constexpr int NUM_PAGES = {pages};",
        f"inline constexpr int DYN_SMEM_BYTES = {pages * PAGE_BYTES + scratch_bytes};",
        f"inline constexpr int PARAM_WORDS = {record.PARAM_WORDS};",
        f"inline constexpr int MPK_ABI_VERSION = {ABI_VERSION};",
        f"inline constexpr int ERR_WORDS = {ERROR_WORDS};",
    ]
    lines += [f"inline constexpr int ERR_{name} = {value};"
              for name, value in ERROR_FIELDS.items()]
    lines += [f"inline constexpr int ERR_CODE_{name} = {value};"
              for name, value in ERROR_CODES.items()]
    lines.append(f"inline constexpr int SMS_WORDS = {SM_STATE_WORDS};")
    lines += [f"inline constexpr int SMS_{name} = {value};"
              for name, value in SM_STATE_FIELDS.items()]
    lines += [f"inline constexpr int SMS_STATUS_{name} = {value};"
              for name, value in SM_STATUS.items()]
    lines.append(f"inline constexpr int SAMPLING_WORDS = {sampling.WORDS};")
    lines += [f"inline constexpr int SAMPLING_{name} = {value};"
              for name, value in sampling.FIELDS.items()]
    lines.append(f"inline constexpr int SAMPLING_P_ONE = {sampling.P_ONE};")
    lines.append(f"inline constexpr int RUN_WORDS = {runs.WORDS};")
    lines.append(f"inline constexpr int RUN_INDEX = {runs.INDEX};")
    lines.append(f"inline constexpr int RUN_WIDTH = {runs.WIDTH};")
    lines.append(f"inline constexpr int PROF_STAMPS = {len(PROFILE_STAMPS)};")
    lines += [f"inline constexpr int PROF_{name} = {value};"
              for name, value in PROFILE_STAMPS.items()]
    return "\n".join(lines)


def outlined(kinds: Sequence[str]) -> frozenset[str]:
    """The kinds called out of line: beside a kind with a wgmma pipeline (TaskKind
    wgmma_pipeline, inlined itself), those marked outlined_beside_wgmma."""
    if not any(get_kind(k).wgmma_pipeline for k in kinds):
        return frozenset()
    return frozenset(k for k in kinds if get_kind(k).outlined_beside_wgmma)


def kind_block(kind_id: int, name: str, constants: Mapping[str, int] | None = None,
               flagged: bool = True, out_of_line: bool = False) -> str:
    """The kind's compile-time constants (defaults raised by the plan), its namespace constants,
    then its device code. `flagged` False: no op of the kind has a flagged operand in the plan,
    so FLAGGED folds its polling and flag-writing paths away (common/flags.cuh flag_epoch).
    `out_of_line`: a __noinline__ `run_outlined` wrapper follows, for the dispatch."""
    kind = get_kind(name)
    constants = constants or {}
    if not _IDENT.match(name):
        raise CompileError(f"task kind {name!r} is not a C++ identifier")
    if len(kind.operands) > record.MAX_OPERANDS:
        raise CompileError(f"task kind {name!r} has {len(kind.operands)} operands; records hold "
                           f"at most {record.MAX_OPERANDS}")
    if len(kind.params) > record.KIND_PARAMS:
        raise CompileError(f"task kind {name!r} has {len(kind.params)} params; op rows hold at "
                           f"most {record.KIND_PARAMS}")
    lines = [f"inline constexpr int {key} = {constants.get(key, value)};"
             for key, value in sorted(kind.cuda_defaults.items())]
    lines += [f"namespace mpk::kinds::{name} {{", f"inline constexpr int KIND_ID = {kind_id};",
              f"inline constexpr bool FLAGGED = {'true' if flagged else 'false'};"]
    lines += [f"inline constexpr int O_{spec.name.upper()} = {slot};"
              for slot, spec in enumerate(kind.operands)]
    lines += [f"inline constexpr int P_{param.name.upper()} = {index};"
              for index, param in enumerate(kind.params)]
    lines += [f"}}  // namespace mpk::kinds::{name}", f'#include "{name}/{ARCH_SUFFIX}.cuh"']
    if out_of_line:
        lines += [f"namespace mpk::kinds::{name} {{",
                  "__device__ __noinline__ void run_outlined(const mpk::TaskArgs& a) { run(a); }",
                  f"}}  // namespace mpk::kinds::{name}"]
    return "\n".join(lines)


def dispatch_block(kinds: Sequence[str], calls: frozenset[str]) -> str:
    """One case a kind; `calls` (outlined) go through their run_outlined wrapper."""
    return "\n".join(f"    case {i}:\n      mpk::kinds::{name}::"
                     f"{'run_outlined' if name in calls else 'run'}(a);\n      break;"
                     for i, name in enumerate(kinds))


def prologue_block(kinds: Sequence[str]) -> str:
    """Cases of dispatch_prologue: the kinds with a prologue (task.py prologue_operands)."""
    return "\n".join(f"    case {i}:\n      mpk::kinds::{name}::prologue(a);\n      break;"
                     for i, name in enumerate(kinds) if get_kind(name).prologue_operands)


def kind_names_block(kinds: Sequence[str]) -> str:
    # A trailing nullptr keeps the array non-empty (and doubles as an end marker).
    names = ", ".join(f'"{name}"' for name in kinds)
    return (f"inline constexpr int MPK_NUM_KINDS = {len(kinds)};\n"
            f"static const char* const MPK_KIND_NAMES[] = {{{names + ', ' if names else ''}"
            f"nullptr}};")


def options_block(profile: bool, kinds: Sequence[str] = ()) -> str:
    lines = ["#define MPK_PROFILE 1  // stamp every record into Params::profile" if profile
             else "// profiling compiled out"]
    readers = [k for k in kinds if get_kind(k).reads_launch_params]
    if readers:
        lines.append(f"#define MPK_TASK_PARAMS 1  // TaskArgs::p, for {', '.join(readers)}")
    return "\n".join(lines)


def render_kinds(kinds: Sequence[str], profile: bool = False, scratch_bytes: int = 16 * 1024,
                 constants: Mapping[str, int] | None = None,
                 flagged: Collection[str] | None = None) -> str:
    """The megakernel source for a tuple of kind names (kind id = position); `profile` selects
    the timestamped build; `scratch_bytes` is the plan's task scratch (Plan.scratch_bytes),
    `constants` its kinds' compile-time constants (Plan.constants) and `flagged` the kinds with
    a flagged operand (flagged_kinds; None: every kind keeps its flagged paths)."""
    if len(set(kinds)) != len(kinds):
        raise CompileError(f"duplicate kinds in {list(kinds)}")
    calls = outlined(kinds)
    holes = {
        "OPTIONS": options_block(profile, kinds),
        "CONSTANTS": constants_block(scratch_bytes),
        "KINDS": "\n\n".join(kind_block(i, name, constants, flagged is None or name in flagged,
                                          name in calls)
                               for i, name in enumerate(kinds)),
        "DISPATCH": dispatch_block(kinds, calls),
        "PROLOGUES": prologue_block(kinds),
        "KIND_NAMES": kind_names_block(kinds),
    }
    template = TEMPLATE.read_text()
    found = set(_HOLE.findall(template))
    if found != set(holes):
        raise AssertionError(f"template holes {sorted(found)} != filled {sorted(holes)}")
    return _HOLE.sub(lambda m: holes[m.group(1)], template)


def flagged_kinds(plan: Plan) -> frozenset[str]:
    """Kinds with an op that accesses a flagged tensor (compiler/flags.py) in `plan`."""
    return frozenset(op.kind for op in plan.ops
                     if any(plan.tensors[tid].flagged for _, tid in op.operands))


def render(plan: Plan, profile: bool = False) -> str:
    """The megakernel .cu source for `plan` (depends only on plan.kinds, its scratch size, its
    constants, which kinds access flagged tensors and `profile`)."""
    return render_kinds(plan.kinds, profile, plan.scratch_bytes, dict(plan.constants),
                        flagged_kinds(plan))


def missing_kernels(kinds: Sequence[str], extra_dirs: Sequence[Path] = ()) -> list[str]:
    """Kinds without a <kind>/sm90.cuh in `extra_dirs` or mpk/tasks (the include search path)."""
    from mpk.tasks.registry import TASKS_DIR

    dirs = [Path(d) for d in extra_dirs] + [TASKS_DIR]
    return [k for k in kinds if not any((d / k / f"{ARCH_SUFFIX}.cuh").exists() for d in dirs)]
