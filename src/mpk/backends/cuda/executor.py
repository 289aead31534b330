"""CudaExecutor: runs a Plan as one persistent megakernel launch per `run()` (or `start()`) call.

Device state (all torch allocations on the executor's device):
  arena       uint8 [arena_bytes]; ACTIVATION tensors are views into it (0xFF-poisoned on request,
              i.e. NaN for bf16/f32, so a read-before-write shows up); a flagged one
              (compiler/flags.py) is u64 words [..., N/2] of a bf16 pair (or [..., N] of an
              int32) and its epoch, which read() strips and write() refuses (only the kernel
              writes epochs);
  counters    int64 [num_counters], zero once and then monotonic (backends/base.py);
  error/abort the watchdog's report (codegen.ERROR_FIELDS) and the stop-everyone flag;
  instrs, lengths, op_params: uploaded once;
  pointer table int64 [num_tensors] of base addresses, rebuilt when a binding changes;
  streams     each Plan.streams entry (the kind's build_stream over its op's bound weights),
              rebuilt when a source is rebound (weights are read-only after bind: change one by
              binding it again); in the pointer table after the plan's tensors;
  profile     (profile=True only) int64 [steps, num_sms, max_len, PROF_STAMPS] %globaltimer
              stamps, allocated per run (codegen.PROFILE_STAMPS; read with last_profile()).
A Plan that is one rank of a tensor-parallel model (allreduce ops over G > 1 ranks) gets its
arena in symmetric memory with the cross-GPU flags after it (backends/cuda/peers.py); creating
its executor is then a collective of the G processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from mpk import env
from mpk.compiler import flags, record
from mpk.compiler.plan import Plan, PlanTensor
from mpk.dtypes import DType
from mpk.errors import KernelHangError, MpkError, UnsupportedError

from . import build, codegen, diagnose, peers
from mpk.tasks.registry import get_kind

from .loader import KernelInfo, Megakernel, Params

BINDABLE_ROLES = ("weight", "io")
_PINNED_WRITE = 1 << 20  # bytes: writes up to this size do not wait for the launches ahead


class CudaExecutor:
    """The Executor protocol (backends/base.py) on a Hopper GPU."""

    def __init__(self, plan: Plan, device: str | int | torch.device | None = None,
                 poison: bool = False, timeout_s: float | None = None, *,
                 extra_includes: Sequence[Path] = (), profile: bool = False) -> None:
        """`extra_includes`: directories searched for <kind>/sm90.cuh before mpk/tasks (tests,
        out-of-tree kinds). `profile`: run the timestamped build (a separate nvcc build) and
        keep every run's stamps for last_profile()."""
        self.plan = plan
        self.device = _cuda_device(device)
        props = torch.cuda.get_device_properties(self.device)
        if props.major < 9:
            raise UnsupportedError(f"{props.name} has compute capability {props.major}."
                                   f"{props.minor}; the CUDA backend needs 9.0 (Hopper) or newer")
        if plan.num_sms > props.multi_processor_count:
            raise UnsupportedError(f"the plan was compiled for {plan.num_sms} SMs but "
                                   f"{props.name} has {props.multi_processor_count}; recompile "
                                   f"with num_sms <= {props.multi_processor_count}")
        self.timeout_s = float(env.watchdog_seconds() if timeout_s is None else timeout_s)
        if self.timeout_s <= 0:
            raise MpkError(f"timeout_s must be positive, got {self.timeout_s}")

        arch = build.arch_for_capability(props.major, props.minor)
        self.profile = bool(profile)
        self.build = build.build_plan(plan, arch=arch, extra_includes=extra_includes,
                                      profile=self.profile)
        self.kernel = Megakernel(self.build.so_path)
        if self.kernel.profiling != self.profile:
            raise MpkError(f"{self.build.so_path} is {'' if self.kernel.profiling else 'not '}a "
                           f"profiling build; delete it to rebuild")
        self.kernel_info: KernelInfo = self.kernel.kernel_info(self.device.index)
        if self.kernel_info.blocks_per_sm < 1:
            raise UnsupportedError(f"the megakernel does not fit on one SM "
                                   f"({self.kernel_info.registers} registers x "
                                   f"{codegen.RUNTIME_THREADS} threads, "
                                   f"{codegen.dynamic_smem_bytes(plan.scratch_bytes)} + "
                                   f"{self.kernel_info.static_smem} bytes of shared memory)")

        dev = self.device
        self._peers: peers.PeerArena | None = None
        if peers.plan_ranks(plan) > 1:
            self._peers = peers.allocate(plan, dev, poison)
            self.arena = self._peers.arena
        else:
            self.arena = torch.full((max(plan.arena_bytes, 1),), 0xFF if poison else 0,
                                    dtype=torch.uint8, device=dev)
        self.counters = torch.zeros(max(plan.num_counters, 1), dtype=torch.int64, device=dev)
        self._error = torch.zeros(codegen.ERROR_WORDS, dtype=torch.int32, device=dev)
        self._abort = torch.zeros(1, dtype=torch.int32, device=dev)
        self._sm_state = torch.zeros(plan.num_sms * codegen.SM_STATE_WORDS, dtype=torch.int32,
                                     device=dev)
        instrs = plan.instrs.reshape(plan.num_sms, -1, record.WORDS)
        self._max_len = int(instrs.shape[1])
        self._instrs = _upload(instrs, dev)
        self._lengths = _upload(plan.lengths, dev)
        self._op_params = _upload(plan.op_params.reshape(-1, record.PARAM_WORDS), dev)

        self._views: dict[int, torch.Tensor] = {}
        self._bound: dict[int, torch.Tensor] = {}
        for i, t in enumerate(plan.tensors):
            if t.offset >= 0:
                self._views[i] = self._arena_view(t)
        self._ptr_table: torch.Tensor | None = None
        self._streams: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
        self._generation: dict[int, int] = {}  # tensor id -> how many binds it has seen
        self._profile: tuple[torch.Tensor, int] | None = None  # last run: stamps, step_begin
        self._dead: str | None = None  # why the executor refuses to run again
        self.step = 0  # global step of the next run

    # ---- Executor protocol -----------------------------------------------------------------
    def bind(self, name: str, tensor: torch.Tensor) -> None:
        tid, spec = self._lookup(name)
        if spec.role not in BINDABLE_ROLES:
            raise MpkError(f"tensor '{name}' is an {spec.role} tensor in the arena; only weight "
                           f"and io tensors can be bound (use write() to set it)")
        want = DType(spec.dtype).torch
        if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != want:
            raise MpkError(f"tensor '{name}': expected shape {tuple(spec.shape)} {want}, got "
                           f"{tuple(tensor.shape)} {tensor.dtype}")
        if tensor.device != self.device or not tensor.is_contiguous():
            # A copy: the kernel reads and writes this device copy, not the caller's tensor.
            tensor = tensor.detach().to(self.device).contiguous()
        if tensor.data_ptr() % 16:
            # The kinds' 16-byte vector paths need their bound operands aligned (rmsnorm with a
            # flagged x has no other path): a view off a 16-byte boundary is copied (fresh
            # allocations are aligned), and, as above, the kernel then uses the copy.
            tensor = tensor.detach().clone()
        self._bound[tid] = tensor
        self._generation[tid] = self._generation.get(tid, 0) + 1  # streams built from it go stale
        self._ptr_table = None

    def write(self, name: str, value: torch.Tensor) -> None:
        if self._lookup(name)[1].flagged:
            raise MpkError(f"tensor '{name}' is a flagged activation: only the kernel writes it "
                           f"(its readers wait for each word's epoch)")
        target = self.tensor(name)
        if tuple(value.shape) != tuple(target.shape):
            raise MpkError(f"write to tensor '{name}': expected shape {tuple(target.shape)}, got "
                           f"{tuple(value.shape)}")
        if value.device.type == "cpu" and value.numel() * value.element_size() <= _PINNED_WRITE:
            # From a pinned copy, without a sync: the copy waits in the stream for the launches
            # started before it, and the host goes on (the caching host allocator keeps the
            # pinned block until the copy is done). Larger writes (not a launch's inputs) sync,
            # so the allocator does not keep big pinned blocks.
            target.copy_(value.pin_memory(), non_blocking=True)
        else:
            target.copy_(value)

    def read(self, name: str) -> torch.Tensor:
        spec = self._lookup(name)[1]
        if spec.flagged:  # the low 32 bits of each word: a bf16 pair or an int32
            low = (self.tensor(name) & 0xFFFFFFFF).to(torch.int32)
            return low.view(DType(spec.dtype).torch).reshape(spec.shape).to("cpu", copy=True)
        return self.tensor(name).detach().to("cpu", copy=True)

    def run(self, num_steps: int = 1) -> None:
        self.start(num_steps).wait()

    def start(self, num_steps: int, reads: Sequence[str] = ()) -> _CudaLaunch:
        """Launch `num_steps` steps and copy `reads` (unflagged tensors) to pinned host memory
        after them, without waiting: wait() on the result syncs and checks the watchdog."""
        if self._dead is not None:
            raise MpkError(f"this CudaExecutor cannot run again: {self._dead}. Create a new one.")
        self.plan.check_steps(num_steps)
        if int(self.plan.lengths.max()) * num_steps >= 2**31:
            raise MpkError(f"{num_steps} steps of {int(self.plan.lengths.max())} records per SM "
                           f"is more than one launch can count (2^31); run fewer steps at once")
        if self._ptr_table is None:  # checked once per binding (a scan of every tensor)
            missing = [t.name for i, t in enumerate(self.plan.tensors)
                       if i not in self._views and i not in self._bound]
            if missing:
                raise MpkError(f"bind these tensors before run(): {', '.join(missing)}")
        sources = {name: self.tensor(name) for name in reads}
        flagged = [name for name in reads if self._lookup(name)[1].flagged]
        if flagged:
            raise MpkError(f"start(): read flagged tensors with read(), not {flagged}")
        stamps = None
        if self.profile:  # zeros: a record that never ran (a stopped launch) keeps no stamps
            stamps = torch.zeros((num_steps, self.plan.num_sms, self._max_len,
                                  len(codegen.PROFILE_STAMPS)), dtype=torch.int64,
                                 device=self.device)
        params = Params(
            instrs=self._instrs.data_ptr(), lengths=self._lengths.data_ptr(),
            op_params=self._op_params.data_ptr(), tensors=self._pointer_table().data_ptr(),
            counters=self.counters.data_ptr(), error=self._error.data_ptr(),
            abort_flag=self._abort.data_ptr(), sm_state=self._sm_state.data_ptr(),
            step_begin=self.step, num_steps=num_steps,
            max_len=self._max_len, timeout_ns=int(self.timeout_s * 1e9),
            profile=None if stamps is None else stamps.data_ptr(), **self._peer_params())
        stream = torch.cuda.current_stream(self.device)
        if self._peers is not None:
            # The ranks' launches must overlap: a rank that reaches its launch seconds later
            # (a slower build, host work) would trip its peers' watchdogs in the all-reduce.
            import torch.distributed as dist

            dist.barrier()
        with torch.cuda.device(self.device):
            rc = self.kernel.launch(params, self.plan.num_sms, self.device.index,
                                    stream.cuda_stream)
            if rc != 0:
                raise MpkError(f"launching the megakernel failed: {self.kernel.error_string(rc)}")
            step_begin, self.step = self.step, self.step + num_steps  # its steps are queued
            try:
                # Each launch its own pinned copies: the next launch may start before this
                # one's wait() and must not overwrite them.
                copies = {name: _to_pinned(t) for name, t in sources.items()}
                error = _to_pinned(self._error)
                done = torch.cuda.Event()
                done.record(stream)
            except Exception as e:  # the launch runs, but its outcome cannot be known
                self._dead = f"a queued launch could not be followed: {e}"
                raise MpkError(self._dead) from e
        return _CudaLaunch(self, done, error, copies, stamps, step_begin)

    def last_profile(self) -> tuple[np.ndarray, int]:
        """The last run's stamps, int64 ns [steps, num_sms, max_len, PROF_STAMPS] (zero past an
        SM's list length), and that run's first global step. Needs profile=True."""
        if not self.profile:
            raise MpkError("last_profile() needs CudaExecutor(..., profile=True)")
        if self._profile is None:
            raise MpkError("last_profile(): no run has finished yet")
        stamps, step_begin = self._profile
        return stamps.cpu().numpy(), step_begin

    # ---- extras ----------------------------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor:
        """The device tensor behind `name` (bound tensor or arena view), no copy; a flagged
        activation's is its int64 words ([..., N/2] for bf16 pairs, [..., N] for int32; read()
        gives the values)."""
        tid, spec = self._lookup(name)
        if tid in self._bound:
            return self._bound[tid]
        if tid in self._views:
            return self._views[tid]
        raise MpkError(f"tensor '{name}' ({spec.role}) is not bound yet: call bind() first")

    # ---- internals -------------------------------------------------------------------------
    def _peer_params(self) -> dict[str, int | None]:
        if self._peers is None:
            return {"peer_arenas": None, "xflags_offset": 0, "rank": 0, "ranks": 1}
        tp = self._peers
        return {"peer_arenas": tp.bases.data_ptr(), "xflags_offset": tp.xflags_offset,
                "rank": tp.rank, "ranks": tp.ranks}

    def _lookup(self, name: str) -> tuple[int, PlanTensor]:
        try:
            tid = self.plan.tensor_id(name)
        except KeyError:
            raise MpkError(f"the plan has no tensor named '{name}'") from None
        return tid, self.plan.tensors[tid]

    def _arena_view(self, t: PlanTensor) -> torch.Tensor:
        nbytes = t.device_nbytes
        if t.offset % 16 or t.offset + nbytes > self.plan.arena_bytes:
            raise MpkError(f"tensor '{t.name}': arena offset {t.offset} (+{nbytes} bytes) is "
                           f"misaligned or outside the arena ({self.plan.arena_bytes} bytes)")
        raw = self.arena[t.offset:t.offset + nbytes]
        if t.flagged:
            words = flags.words_per_row(DType(t.dtype), t.shape[-1])
            return raw.view(torch.int64).view(*t.shape[:-1], words)
        return raw.view(DType(t.dtype).torch).view(t.shape)

    def _stream(self, op_index: int) -> torch.Tensor:
        """The op's weight stream, built from its bound sources (cached per binding)."""
        op = self.plan.ops[op_index]
        view = self.plan.op_view(op_index)
        kind = get_kind(op.kind)
        layout = kind.stream_layout(view)
        operands = dict(op.operands)
        sources = {name: self._bound[operands[name]] for name in layout.sources}
        key = tuple(self._generation[operands[name]] for name in layout.sources)
        cached = self._streams.get(op_index)
        if cached is None or cached[0] != key:
            with torch.cuda.device(self.device), torch.no_grad():
                stream = kind.build_stream(view, sources).contiguous()
            if stream.numel() * stream.element_size() != layout.total_bytes:
                raise AssertionError(f"{op.name}: stream of {stream.numel()} elements, the "
                                     f"layout says {layout.total_bytes} bytes")
            self._streams[op_index] = cached = (key, stream)
        return cached[1]

    def _pointer_table(self) -> torch.Tensor:
        if self._ptr_table is None:
            ptrs = [(self._bound[i] if i in self._bound else self._views[i]).data_ptr()
                    for i in range(len(self.plan.tensors))]
            ptrs += [self._stream(s.op).data_ptr() for s in self.plan.streams]
            self._ptr_table = torch.tensor(ptrs or [0], dtype=torch.int64).to(self.device)
        return self._ptr_table

    def _failure(self, err: list[int], step_begin: int) -> MpkError:
        f = codegen.ERROR_FIELDS
        code, sm, task, index = err[f["CODE"]], err[f["SM"]], err[f["TASK"]], err[f["INDEX"]]
        step = record.join64(err[f["STEP_LO"]], err[f["STEP_HI"]])
        try:
            name = self.plan.task_name(task)
            story = diagnose.explain(
                self.plan, self._sm_state.cpu().numpy().reshape(self.plan.num_sms, -1),
                self.counters.cpu().numpy(), step_begin)
        except Exception as e:  # a corrupt record must not hide the report
            name, story = "?", f"(no diagnosis: {e!r})"
        if code == codegen.ERROR_CODES["BAD_KIND"]:
            return MpkError(f"task {task} {name} on SM {sm} has kind id {err[f['KIND']]}, which "
                            f"this megakernel does not know (plan kinds: {list(self.plan.kinds)})")
        counter = err[f["COUNTER"]]
        value = record.join64(err[f["VALUE_LO"]], err[f["VALUE_HI"]])
        target = record.join64(err[f["TARGET_LO"]], err[f["TARGET_HI"]])
        if code == codegen.ERROR_CODES["PEER_TIMEOUT"]:
            return KernelHangError(
                f"the megakernel watchdog ({self.timeout_s:g} s) stopped the kernel: task {task} "
                f"{name} on SM {sm} waited for tensor-parallel rank {counter}'s partial of global "
                f"step {step} (its flag is {value}, needs {target}); that rank is slower by more "
                f"than the watchdog, stopped, or runs another plan.\n{story}\n"
                f"The executor's counters are now inconsistent; create a new executor.")
        what = (f"counter {counter}: value {value}, needs {target}" if counter >= 0 else "")
        if code == codegen.ERROR_CODES["POLL_TIMEOUT"]:
            what = "polled flagged data that never carried its epoch" + (
                f" (its producers' {what})" if counter >= 0 else "")
        return KernelHangError(
            f"the megakernel watchdog ({self.timeout_s:g} s) stopped the kernel.\n{story}\n"
            f"first timeout: task {task} {name} on SM {sm} (position {index}) at global step "
            f"{step}, {what}.\n"
            f"The executor's counters are now inconsistent; create a new executor.")


class _CudaLaunch:
    """A launch in the stream (CudaExecutor.start); wait() once."""

    def __init__(self, executor: CudaExecutor, done: torch.cuda.Event, error: torch.Tensor,
                 copies: dict[str, torch.Tensor], stamps: torch.Tensor | None,
                 step_begin: int) -> None:
        self.executor, self.done, self.error, self.copies = executor, done, error, copies
        self.stamps, self.step_begin = stamps, step_begin

    def wait(self) -> dict[str, torch.Tensor]:
        ex = self.executor
        try:
            self.done.synchronize()
        except RuntimeError as e:  # a fault inside a task: the context is unusable
            ex._dead = f"the megakernel failed: {e}"
            raise MpkError(ex._dead) from e
        err = self.error.tolist()
        if err[codegen.ERROR_FIELDS["CODE"]] != 0:
            ex._dead = "its megakernel was stopped by the watchdog, counters are inconsistent"
            raise ex._failure(err, self.step_begin)
        if self.stamps is not None:  # copied to the host on request, outside any timed region
            ex._profile = (self.stamps, self.step_begin)
        return self.copies


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of device tensor t, taken in stream order (valid after a sync)."""
    host = torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _cuda_device(device: str | int | torch.device | None) -> torch.device:
    if not torch.cuda.is_available():
        raise UnsupportedError("the CUDA backend needs a CUDA GPU, but torch.cuda is not "
                               "available here; use the 'cpu' backend")
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(
        device if device is not None else "cuda")
    if dev.type != "cuda":
        raise UnsupportedError(f"the CUDA backend runs on a cuda device, not {dev}")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def _upload(array: object, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(array).to(torch.int32).contiguous().reshape(-1)
    if t.numel() == 0:  # a valid pointer even for empty tables
        t = torch.zeros(1, dtype=torch.int32)
    return t.to(device)
