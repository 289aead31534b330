"""The contract every task kind fulfils.

A task kind describes one tile of an operator: its operands, the shape rules, the torch reference
for one tile (the CPU interpreter's semantics), the per-op parameter words the CUDA device function
reads, and a cost for the scheduler. Kinds register themselves with `@register`; nothing lists them.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from mpk.errors import GraphError
from mpk.tensors import TensorSpec

Split = tuple[int | None, int | None, int | None]

# The CUDA runtime's shared-memory page: the most bytes of a weight stream one page holds.
PAGE_BYTES = 16 * 1024
# The threads a CUDA task runs on (the consumers; codegen's NUM_THREADS): kinds that size their
# work per warp read TASK_WARPS.
TASK_THREADS = 256
TASK_WARPS = TASK_THREADS // 32

# The largest tensor compiler/flags.py flags (its contract there; kinds size scratch for it). A
# linear reader polls its 16-byte vectors up to four a thread in flight (linear/sm90.cuh
# poll_stage: 256 threads, 16 KB a round, 32 KB in two); polled one after the other, batch 8's
# 16 KB hidden (four a thread, four L2 round trips) lost to plain copies: qwen3-0.6b b8 1.178 ->
# 1.200 ms (perf-log, fourteenth session), so the limit was 8 KB until the reads went out
# together, 16 KB with them (twenty-ninth session). 32 KB against 16 (thirtieth session, H100):
# qwen3-0.6b b4 -5 to -7%, b16 -1.3 to -1.9%, llama-3.2-1b b8 and qwen3-8b b1 ~-0.3%; a kind
# may allow its outputs less (attention: task.py FLAGGED_OUT_MAX_BYTES).
FLAG_MAX_BYTES = 32 * 1024

Box = tuple[tuple[int, int], ...]


class Access(enum.Enum):
    READ = "r"
    WRITE = "w"
    READ_WRITE = "rw"

    @property
    def reads(self) -> bool:
        return self is not Access.WRITE

    @property
    def writes(self) -> bool:
        return self is not Access.READ


@dataclass(frozen=True)
class OperandSpec:
    name: str
    access: Access
    optional: bool = False
    # A weight operand never depends on this step's activations, so the runtime may start loading
    # it before the task's waits are satisfied (prefetch), and the cost model counts it as streamed.
    weight: bool = False


@dataclass(frozen=True)
class Param:
    """One 32-bit word of an op's parameter row; floats travel as their IEEE bits."""

    name: str
    is_float: bool = False


@dataclass(frozen=True)
class TaskCost:
    """Bytes and flops of ONE task (one grid point), and the global-memory round trips it makes
    one after another (each waits for the last: latency its bytes do not show; 0 where the
    bytes set the time). `prologue_round_trips`: those of its prologue (prologue_operands), which
    runs once its SM is free, before its producers are done: off the critical path only on an
    SM that is free early enough."""

    weight_bytes: int
    act_bytes: int
    flops: int
    round_trips: int = 0
    prologue_round_trips: int = 0


@dataclass(frozen=True)
class StreamLayout:
    """A kind's GPU weight stream for one op: the bytes its tasks read from shared-memory pages
    that the runtime's loader fills ahead of time (weights never depend on activations).

    The stream is one device buffer built at bind time from `sources` (weight operands) by the
    kind's `build_stream`; task t's part starts at byte `offsets[t]` and is cut into pages as
    `runs[t]` says: (page count, bytes per page) pairs, in order (record.STREAM_RUNS)."""

    sources: tuple[str, ...]
    offsets: tuple[int, ...]
    runs: tuple[tuple[tuple[int, int], ...], ...]
    total_bytes: int


@dataclass(frozen=True)
class OpView:
    """What a task kind sees of one op: its operands' specs, grid, splits and attributes."""

    name: str
    kind: str
    grid: tuple[int, int, int]
    tensors: Mapping[str, TensorSpec]
    splits: Mapping[str, Split]
    attrs: Mapping[str, Any]

    @property
    def num_tasks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def has(self, operand: str) -> bool:
        return operand in self.tensors

    def shape(self, operand: str) -> tuple[int, ...]:
        return self.tensors[operand].shape

    def tile_shape(self, operand: str) -> tuple[int, ...]:
        shape = list(self.shape(operand))
        for axis, dim in enumerate(self.splits[operand]):
            if dim is not None:
                shape[dim] //= self.grid[axis]
        return tuple(shape)

    def split_count(self, operand: str, dim: int) -> int:
        """How many tiles the grid cuts `dim` of `operand` into."""
        for axis, d in enumerate(self.splits[operand]):
            if d == dim:
                return self.grid[axis]
        return 1

    def axis_of(self, operand: str, dim: int) -> int | None:
        for axis, d in enumerate(self.splits[operand]):
            if d == dim:
                return axis
        return None

    def error(self, message: str) -> GraphError:
        return GraphError(f"layer '{self.name}' ({self.kind}): {message}")

    def expect_shape(self, operand: str, shape: tuple[int, ...]) -> None:
        got = self.shape(operand)
        if got != tuple(shape):
            raise self.error(f"tensor '{self.tensors[operand].name}' (operand '{operand}') "
                             f"has shape {got}, expected {tuple(shape)}")

    def expect_dtype(self, operand: str, *dtypes: Any) -> None:
        got = self.tensors[operand].dtype
        if got not in dtypes:
            names = ", ".join(d.value for d in dtypes)
            raise self.error(f"tensor '{self.tensors[operand].name}' (operand '{operand}') "
                             f"is {got.value}, expected {names}")

    def expect_unsplit(self, operand: str, *dims: int) -> None:
        for dim in dims:
            if self.split_count(operand, dim) != 1:
                raise self.error(f"operand '{operand}' may not be split along dim {dim}")

    def expect_same_split(self, a: str, dim_a: int, b: str, dim_b: int) -> None:
        if self.axis_of(a, dim_a) != self.axis_of(b, dim_b):
            raise self.error(f"operands '{a}' dim {dim_a} and '{b}' dim {dim_b} must be split "
                             f"by the same grid axis")


@dataclass
class Tile:
    """One task's operands as views into the interpreter's tensors (the tile, not the whole)."""

    op: OpView
    point: tuple[int, int, int]
    views: dict[str, torch.Tensor]
    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # Adds this task's arrival to its group's counter (TaskKind.arrivals) and says whether it was
    # the group's last this step; set by the interpreter for kinds with arrivals.
    arrive: Callable[[], bool] | None = None

    def __getitem__(self, operand: str) -> torch.Tensor:
        return self.views[operand]

    def has(self, operand: str) -> bool:
        return operand in self.views

    def attr(self, key: str) -> Any:
        return self.op.attrs[key]


class TaskKind:
    """Base class of task kinds. Subclasses set the class variables and override the methods."""

    name: ClassVar[str]
    operands: ClassVar[tuple[OperandSpec, ...]]
    params: ClassVar[tuple[Param, ...]] = ()
    attrs: ClassVar[Mapping[str, Any]] = {}
    # True when the kind's CUDA code reads the launch's Params (TaskArgs::p), e.g. the global
    # step or the tensor-parallel peers; megakernels without such a kind compile without it.
    reads_launch_params: ClassVar[bool] = False
    # Written operands whose tasks' writes are disjoint at run time although their boxes overlap
    # (data-dependent addresses, e.g. KV-cache appends through page tables); the kind's
    # docstring says why. Exempt from the graph's no-overlap check between tasks of one op.
    disjoint_writes: ClassVar[tuple[str, ...]] = ()
    # Operands the kind's CUDA `prologue(a)` reads BEFORE the task's waits are met (the consumers
    # run it while the controller polls the counters, so its loads overlap the wait instead of
    # following it). They must be tensors no op of the graph writes (host-written IO, weights):
    # nothing orders them with other tasks. Graph.add_op checks that; the CPU semantics ignore it.
    prologue_operands: ClassVar[tuple[str, ...]] = ()
    # True when the kind's CUDA code keeps wgmma accumulators in flight across its k loop. ptxas
    # serializes every wgmma of a pipeline that may cross a function call (warning C7510), so
    # such a kind is inlined into the dispatch, and needs the consumers' register budget there.
    wgmma_pipeline: ClassVar[bool] = False
    # True when, in a plan with a wgmma_pipeline kind, the kind is called out of line
    # (codegen.dispatch_block): inlined beside such a kind, its code made ptxas spill in the
    # consumers' loop; the call costs it a few register saves a task.
    outlined_beside_wgmma: ClassVar[bool] = False

    def check(self, op: OpView) -> None:
        """Raise GraphError (via op.error) when shapes, dtypes, splits or attrs are wrong."""

    def default_splits(self, grid: tuple[int, int, int],
                       tensors: Mapping[str, TensorSpec]) -> dict[str, Split]:
        """Splits used when the caller gives none; the default splits nothing."""
        return {name: (None, None, None) for name in tensors}

    def param_values(self, op: OpView) -> dict[str, int | float]:
        """Values of `params` for this op (one row of 32-bit words for the CUDA side)."""
        return {}

    def reference(self, tile: Tile) -> None:
        """Compute one tile with torch on the CPU, writing the output views in place."""
        raise NotImplementedError

    def cost(self, op: OpView) -> TaskCost:
        raise NotImplementedError

    def region(self, op: OpView, operand: str, point: tuple[int, int, int]) -> Box:
        """The part of `operand` one task touches. Default: the tile its split gives."""
        return split_box(op, operand, point, self.split_align(op, operand))

    def split_align(self, op: OpView, operand: str) -> int | None:
        """None: the grid must cut `operand` into equal tiles. An int a: tiles may differ, each
        starting at a multiple of a (see split_bounds); the kind's kernel computes the same
        bounds from its grid point."""
        return None

    # ---- the CUDA runtime -----------------------------------------------------------------
    def cuda_unsupported(self, op: OpView) -> str | None:
        """Why the kind's CUDA kernel cannot run this op (the CUDA build refuses the plan with
        it), or None. The interpreter runs every op its check() accepts."""
        return None

    def scratch_bytes(self, op: OpView) -> int:
        """Shared memory one task of this op needs (TaskArgs::smem); the plan's largest sets the
        runtime's scratch size, and the rest of shared memory becomes weight pages."""
        return 16 * 1024

    # Compile-time constants the kind's CUDA code reads (name -> default); a plan's ops may raise
    # them (cuda_constants), the build takes the largest value over the plan's ops.
    cuda_defaults: ClassVar[Mapping[str, int]] = {}

    def cuda_constants(self, op: OpView, flagged: frozenset[str] = frozenset()
                       ) -> dict[str, int]:
        """Values of cuda_defaults this op needs (e.g. a register-array size); `flagged`: its
        operands whose tensor the plan flags (compiler/flags.py)."""
        return {}

    def flag_operands(self, op: OpView) -> frozenset[str]:
        """Operands whose tensor this op's CUDA code can access in the flagged form
        (compiler/flags.py): reads poll each 64-bit word until it carries the epoch the
        operand's flag entry names; writes store whole bf16 pairs with their epoch, each computed
        from (so after) the task's reads of its whole inputs: a consumer that saw any output word
        may then overwrite those inputs. (A word read and rewritten in place, the residual, is
        read by the thread that writes it, or before a task barrier in front of its store:
        moe_down.) A task polls every word of its flagged reads on
        every path, even one that computes nothing: the compiler lets its counter waits go
        (record.POLLED) on the strength of those polls. Default: none."""
        return frozenset()

    def arrivals(self, op: OpView) -> tuple[int, int] | None:
        """(groups, tasks per group) when the op's tasks meet on counters of their own: each task
        adds one to its group's (Tile.arrive; on the GPU an atomic add on the launch's counters
        at index params[ARRIVALS_PARAM] + group, after a release fence) and the one whose add
        completes the group's count this step does the group's closing work (attention: the
        merge of its KV splits). In a step either every task of a group adds or none does
        (attention: a row whose context uses one split), so the closing add is the one that
        makes the counter a multiple of the group's tasks. The compiler places the counters
        after the dependency counters (zeroed once, monotonic). No record waits on them.
        Default: None."""
        return None

    def arrival_group(self, op: OpView, point: tuple[int, int, int]) -> int:
        """The group (0 .. groups - 1) whose counter the task at `point` adds to (arrivals)."""
        raise NotImplementedError

    def stream_layout(self, op: OpView) -> StreamLayout | None:
        """The op's weight stream, or None when its tasks read weights from global memory."""
        return None

    def build_stream(self, op: OpView, sources: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The stream's bytes (any dtype, contiguous, 16-byte multiples per page) from the bound
        source tensors, on their device; called once per binding by the CUDA executor."""
        raise NotImplementedError

    # ---- helpers shared by all kinds -------------------------------------------------------
    def operand(self, name: str) -> OperandSpec:
        for spec in self.operands:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def param_words(self, op: OpView) -> list[int]:
        values = self.param_values(op)
        missing = [p.name for p in self.params if p.name not in values]
        if missing:
            raise AssertionError(f"{self.name}.param_values misses {missing}")
        return [float_bits(values[p.name]) if p.is_float else int(values[p.name])
                for p in self.params]


def split_box(op: OpView, operand: str, point: tuple[int, int, int],
              align: int | None = None) -> Box:
    """The tile of `operand` at grid point `point`: equal tiles, or with `align` the uneven
    tiles of split_bounds."""
    shape = op.shape(operand)
    box = [(0, d) for d in shape]
    for axis, dim in enumerate(op.splits[operand]):
        if dim is None:
            continue
        if align is None:
            size = shape[dim] // op.grid[axis]
            box[dim] = (point[axis] * size, (point[axis] + 1) * size)
        else:
            box[dim] = split_bounds(shape[dim], op.grid[axis], align, point[axis])
    return tuple(box)


def split_bounds(size: int, parts: int, align: int, index: int) -> tuple[int, int]:
    """[lo, hi) of part `index` when `size` items are cut into `parts` contiguous ranges that
    start at multiples of `align` and differ by at most `align` items (the last may be short).
    Kernels that accept uneven splits compute the same (tasks/common/split.cuh)."""
    units = -(-size // align)
    lo = min(size, align * (index * units // parts))
    hi = min(size, align * ((index + 1) * units // parts))
    return lo, hi


def float_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", float(value)))[0]


def grid_points(grid: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Every grid point in task order: axis 0 fastest, then axis 1, then axis 2."""
    return [(i, j, k) for k in range(grid[2]) for j in range(grid[1]) for i in range(grid[0])]


def boxes_overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """bool [len(b), len(a)]: does box b[j] intersect box a[i]? Boxes: [n, ndim, 2] [lo, hi)."""
    lo = np.maximum(b[:, None, :, 0], a[None, :, :, 0])
    hi = np.minimum(b[:, None, :, 1], a[None, :, :, 1])
    return np.all(lo < hi, axis=-1)
