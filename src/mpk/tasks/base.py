"""The contract every task kind fulfils.

A task kind describes one tile of an operator: its operands, the shape rules, the torch reference
for one tile (the CPU interpreter's semantics), the per-op parameter words the CUDA device function
reads, and a cost for the scheduler. Kinds register themselves with `@register`; nothing lists them.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from mpk.errors import GraphError
from mpk.tensors import TensorSpec

Split = tuple[int | None, int | None, int | None]
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
    """Bytes and flops of ONE task (one grid point)."""

    weight_bytes: int
    act_bytes: int
    flops: int


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
        return split_box(op, operand, point)

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


def split_box(op: OpView, operand: str, point: tuple[int, int, int]) -> Box:
    shape = op.shape(operand)
    box = [(0, d) for d in shape]
    for axis, dim in enumerate(op.splits[operand]):
        if dim is not None:
            size = shape[dim] // op.grid[axis]
            box[dim] = (point[axis] * size, (point[axis] + 1) * size)
    return tuple(box)


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
