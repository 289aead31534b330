"""CpuExecutor: runs a Plan on the CPU, one task at a time, with each kind's torch reference.

This is THE reference semantics of a Plan: the same records, counters and step numbering as the
CUDA runtime. Activations are poisoned (NaN, or a huge int) when allocated, so a read of memory
no task wrote shows up in the results.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable

import numpy as np
import torch

from mpk.backends.cpu.orders import ORDERS, Counters, free_order, per_sm_order
from mpk.compiler import record
from mpk.compiler.plan import Plan
from mpk.dtypes import DType
from mpk.errors import MpkError
from mpk.tasks.base import Tile, grid_points
from mpk.tasks.registry import get_kind

# fp32 copies of bound bf16 weights, shared by every executor in the process (tied names, and
# an engine's decode, wide and prefill plans, bind the same weights): (address, shape, strides)
# -> (a weak reference to the source, its copy). A copy is handed out only while its source
# lives, so its address cannot have been reused by other data; weights are never written.
_FP32: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}


def _fp32_copy(tensor: torch.Tensor) -> torch.Tensor:
    key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
    hit = _FP32.get(key)
    if hit is not None and hit[0]() is not None:
        return hit[1]
    copy = tensor.float()
    _FP32[key] = (weakref.ref(tensor, lambda _, key=key: _FP32.pop(key, None)), copy)
    return copy

INT_POISON = -(2**31) + 7


def poison_(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(INT_POISON)


# (task id, the task's operand views) -> extra inputs for the tile (Tile.extra), e.g. the
# peers' partials of a tensor-parallel all-reduce that live in another process.
TileExtra = Callable[[int, dict[str, torch.Tensor]], dict[str, object]]


class CpuExecutor:
    def __init__(self, plan: Plan, order: str = "schedule", seed: int | None = None,
                 poison: bool = True, priority: Callable[[int], float] | None = None,
                 tile_extra: TileExtra | None = None) -> None:
        if order not in ORDERS:
            raise MpkError(f"unknown order {order!r}; use one of {ORDERS}")
        self.plan = plan
        self.order = order
        self.rng = random.Random(seed)
        self.priority = priority
        self.tile_extra = tile_extra
        self.counters = Counters(plan.num_counters)
        self.step_begin = 0
        self.tensors: dict[str, torch.Tensor] = {}
        for t in plan.tensors:
            if t.offset >= 0:
                buf = torch.empty(t.shape, dtype=DType(t.dtype).torch)
                self.tensors[t.name] = poison_(buf) if poison else buf.zero_()
        self._views: dict[int, dict[str, torch.Tensor]] | None = None
        self._upcast: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name: (source, fp32)
        self._kinds = [get_kind(k) for k in plan.kinds]
        self._op_views = [plan.op_view(i) for i in range(len(plan.ops))]

    # ---- Executor protocol -----------------------------------------------------------------
    def bind(self, name: str, tensor: torch.Tensor) -> None:
        spec = self._spec(name)
        if spec.offset >= 0:
            raise MpkError(f"tensor {name!r} is an activation in the plan's arena; use write()")
        _check_like(name, tensor, tuple(spec.shape), DType(spec.dtype).torch)
        tensor = tensor if tensor.device.type == "cpu" else tensor.cpu()
        if spec.role == "weight" and tensor.dtype == torch.bfloat16:
            # Weights are read-only: keep an exact fp32 copy so each tile's fp32 math does not
            # convert its weights again (the source is kept too, so its address stays taken).
            self._upcast[name] = (tensor, _fp32_copy(tensor))
            tensor = self._upcast[name][1]
        self.tensors[name] = tensor
        self._views = None

    def write(self, name: str, value: torch.Tensor) -> None:
        spec = self._spec(name)
        if name not in self.tensors:
            raise MpkError(f"tensor {name!r} is not bound yet")
        _check_like(name, value, tuple(spec.shape), None)
        self.tensors[name].copy_(value)

    def read(self, name: str) -> torch.Tensor:
        self._spec(name)
        return self.tensors[name].clone()

    def run(self, num_steps: int = 1) -> None:
        self.plan.check_steps(num_steps)
        missing = [t.name for t in self.plan.tensors if t.name not in self.tensors]
        if missing:
            raise MpkError(f"bind these tensors before running: {', '.join(missing)}")
        views = self._task_views()
        threads = torch.get_num_threads()
        # Tiles are small: intra-op threads cost more than they give (and spin badly when the
        # machine is busy), so the interpreter runs single-threaded.
        torch.set_num_threads(1)
        try:
            for rec, step in self._order(num_steps):
                task = int(rec[record.TASK])
                extra = self.tile_extra(task, views[task]) if self.tile_extra else {}
                self.execute(rec, step, views[task], extra)
        finally:
            torch.set_num_threads(threads)
        self.step_begin += num_steps

    # ---- internals -------------------------------------------------------------------------
    def _order(self, num_steps: int):
        if self.order == "free":
            prio = self.priority or (lambda t: self.rng.random())
            return free_order(self.plan, self.counters, self.step_begin, num_steps, prio)
        rng = self.rng if self.order == "random" else None
        return per_sm_order(self.plan, self.counters, self.step_begin, num_steps, rng)

    def execute(self, rec: np.ndarray, step: int, views: dict[str, torch.Tensor],
                extra: dict[str, object]) -> None:
        """Run one record's task at local step `step` (its reference on its tile's views)."""
        point = tuple(int(x) for x in rec[record.POINT: record.POINT + 3])
        tile = Tile(self._op_views[int(rec[record.OP])], point,  # type: ignore[arg-type]
                    views, step, extra, self._arrival(rec, point))
        self._kinds[int(rec[record.KIND])].reference(tile)

    def _arrival(self, rec: np.ndarray, point: tuple[int, int, int]
                 ) -> Callable[[], bool] | None:
        """Tile.arrive for a task of an op with arrival counters (TaskKind.arrivals)."""
        op = int(rec[record.OP])
        first = int(self.plan.op_params[op, record.ARRIVALS_PARAM])
        if first < 0:
            return None
        kind = self._kinds[int(rec[record.KIND])]
        counter = first + kind.arrival_group(self._op_views[op], point)
        count = int(self.plan.counter_counts[counter])
        return lambda: self.counters.arrive(counter, count)

    def _spec(self, name: str):
        try:
            return self.plan.tensor(name)
        except KeyError:
            raise MpkError(f"the plan has no tensor named {name!r}") from None

    def _task_views(self) -> dict[int, dict[str, torch.Tensor]]:
        if self._views is None:
            self._views = {}
            for op_index, op in enumerate(self.plan.ops):
                view = self._op_views[op_index]
                kind = get_kind(op.kind)
                points = grid_points(op.grid)
                for local, point in enumerate(points):
                    self._views[op.first_task + local] = {
                        operand: self.tensors[self.plan.tensors[tid].name][
                            tuple(slice(lo, hi) for lo, hi in kind.region(view, operand, point))]
                        for operand, tid in op.operands
                    }
        return self._views



def _check_like(name: str, t: torch.Tensor, shape: tuple[int, ...],
                dtype: torch.dtype | None) -> None:
    if tuple(t.shape) != shape:
        raise MpkError(f"tensor {name!r}: expected shape {shape}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise MpkError(f"tensor {name!r}: expected dtype {dtype}, got {t.dtype}")

