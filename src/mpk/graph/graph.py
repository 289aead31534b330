"""The Graph: an ordered list of ops over named tensors. Program order is the op order."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpk.dtypes import DType
from mpk.errors import GraphError
from mpk.tensors import Role, TensorSpec, check_name
from mpk.tasks.base import OpView, Split, boxes_overlap, grid_points
from mpk.tasks.registry import get_kind

# The SM count plans target when no GPU says otherwise (H100 SXM / H200). Backends that know
# their device ask it instead (mpk.backends.registry).
DEFAULT_NUM_SMS = 132


@dataclass(frozen=True)
class Op:
    name: str
    kind: str
    grid: tuple[int, int, int]
    operands: tuple[tuple[str, str], ...]  # (operand name, tensor name)
    splits: tuple[tuple[str, Split], ...]
    attrs: tuple[tuple[str, Any], ...]

    @property
    def num_tasks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def tensor_of(self, operand: str) -> str:
        return dict(self.operands)[operand]


class Graph:
    """Tensors and ops. Adding an op validates it against its task kind at once."""

    def __init__(self) -> None:
        self.tensors: dict[str, TensorSpec] = {}
        self.ops: list[Op] = []
        self._op_names: set[str] = set()
        # Tensors some op writes, and tensors some op's prologue reads (task.py
        # prologue_operands): the two sets must stay apart.
        self._written: dict[str, str] = {}
        self._prologue_read: dict[str, str] = {}

    # ---- tensors -----------------------------------------------------------------------------
    def add_tensor(self, name: str, shape: tuple[int, ...], dtype: DType, role: Role) -> TensorSpec:
        if name in self.tensors:
            raise GraphError(f"duplicate tensor name {name!r}")
        spec = TensorSpec(name, tuple(int(d) for d in shape), dtype, role)
        self.tensors[name] = spec
        return spec

    # ---- ops ---------------------------------------------------------------------------------
    def add_op(self, kind: str, name: str, grid: tuple[int, ...],
               operands: Mapping[str, str | TensorSpec],
               splits: Mapping[str, Split] | None = None, **attrs: Any) -> Op:
        check_name(name, "layer")
        if name in self._op_names:
            raise GraphError(f"duplicate layer name {name!r}")
        task = get_kind(kind)
        grid3 = _grid3(name, grid)
        tensors = self._operand_tensors(name, kind, task, operands)
        given = dict(splits or {})
        full = {k: v for k, v in task.default_splits(grid3, tensors).items() if k in tensors}
        for operand, split in given.items():
            if operand not in tensors:
                raise GraphError(f"layer '{name}' ({kind}): split given for unknown operand "
                                 f"{operand!r}")
            full[operand] = _split3(name, operand, split)
        for operand in tensors:
            full.setdefault(operand, (None, None, None))
        merged = {**task.attrs, **attrs}
        unknown = set(attrs) - set(task.attrs)
        if unknown:
            raise GraphError(f"layer '{name}' ({kind}): unknown attribute(s) {sorted(unknown)}; "
                             f"allowed: {sorted(task.attrs)}")
        view = OpView(name, kind, grid3, tensors, full, merged)
        _check_splits(view, task)
        task.check(view)
        _check_partition(view, task)
        _check_no_overlap_between_tasks(view, task)
        self._check_prologue_inputs(name, task, tensors)
        op = Op(name, kind, grid3, tuple((k, v.name) for k, v in tensors.items()),
                tuple(full.items()), tuple(sorted(merged.items())))
        self.ops.append(op)
        self._op_names.add(name)
        return op

    def _check_prologue_inputs(self, name: str, task: Any, tensors: Mapping[str, TensorSpec]
                               ) -> None:
        """A prologue runs before its task's waits: it may read no tensor that any op writes."""
        writes = {t.name for o, t in tensors.items() if task.operand(o).access.writes}
        reads = {tensors[o].name for o in task.prologue_operands if o in tensors}
        for tensor in sorted(reads):
            if tensor in self._written or tensor in writes:
                writer = self._written.get(tensor, name)
                raise GraphError(f"layer '{name}' ({task.name}) reads tensor '{tensor}' before "
                                 f"its waits (prologue), but layer '{writer}' writes it")
        for tensor in sorted(writes):
            if tensor in self._prologue_read:
                raise GraphError(f"layer '{name}' ({task.name}) writes tensor '{tensor}', which "
                                 f"layer '{self._prologue_read[tensor]}' reads before its "
                                 f"waits (prologue)")
        for tensor in writes:
            self._written.setdefault(tensor, name)
        for tensor in reads:
            self._prologue_read.setdefault(tensor, name)

    def view(self, op: Op) -> OpView:
        tensors = {operand: self.tensors[t] for operand, t in op.operands}
        return OpView(op.name, op.kind, op.grid, tensors, dict(op.splits), dict(op.attrs))

    def _operand_tensors(self, name: str, kind: str, task: Any,
                         operands: Mapping[str, str | TensorSpec]) -> dict[str, TensorSpec]:
        out: dict[str, TensorSpec] = {}
        known = {spec.name for spec in task.operands}
        for operand in operands:
            if operand not in known:
                raise GraphError(f"layer '{name}' ({kind}): unknown operand {operand!r}; "
                                 f"expected {sorted(known)}")
        for spec in task.operands:
            if spec.name not in operands or operands[spec.name] is None:
                if not spec.optional:
                    raise GraphError(f"layer '{name}' ({kind}): missing operand {spec.name!r}")
                continue
            ref = operands[spec.name]
            tname = ref.name if isinstance(ref, TensorSpec) else ref
            if tname not in self.tensors:
                raise GraphError(f"layer '{name}' ({kind}): operand {spec.name!r} names unknown "
                                 f"tensor {tname!r}")
            tensor = self.tensors[tname]
            if spec.access.writes and tensor.role is Role.WEIGHT:
                raise GraphError(f"layer '{name}' ({kind}): writes weight tensor {tname!r}")
            out[spec.name] = tensor
        return out


def _grid3(name: str, grid: tuple[int, ...]) -> tuple[int, int, int]:
    g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
    if len(g) != 3 or any(x <= 0 for x in g):
        raise GraphError(f"layer '{name}': grid {grid} must be 1 to 3 positive integers")
    return g  # type: ignore[return-value]


def _split3(name: str, operand: str, split: Any) -> Split:
    s = tuple(split) + (None,) * (3 - len(tuple(split)))
    if len(s) != 3 or any(d is not None and (not isinstance(d, int) or d < 0) for d in s):
        raise GraphError(f"layer '{name}': split of {operand!r} must give, per grid axis, a "
                         f"tensor dim or None; got {split!r}")
    return s  # type: ignore[return-value]


def _check_splits(view: OpView, task: Any) -> None:
    for operand, split in view.splits.items():
        align = task.split_align(view, operand)
        tensor = view.tensors[operand]
        dims = [d for d in split if d is not None]
        if len(dims) != len(set(dims)):
            raise view.error(f"operand {operand!r}: two grid axes split the same dim")
        for axis, dim in enumerate(split):
            if dim is None:
                continue
            if dim >= len(tensor.shape):
                raise view.error(f"operand {operand!r}: tensor '{tensor.name}' has "
                                 f"{len(tensor.shape)} dims, cannot split dim {dim}")
            if align is not None:
                _check_aligned_split(view, operand, axis, dim, align)
            elif tensor.shape[dim] % view.grid[axis]:
                raise view.error(f"grid axis {axis} ({view.grid[axis]} tasks) does not divide "
                                 f"dim {dim} (size {tensor.shape[dim]}) of tensor "
                                 f"'{tensor.name}' (operand {operand!r})")


def _check_aligned_split(view: OpView, operand: str, axis: int, dim: int, align: int) -> None:
    """Grid axis `axis` cuts dim `dim` of `operand` into uneven ranges of whole `align` pieces."""
    tensor = view.tensors[operand]
    pieces, tasks = -(-tensor.shape[dim] // align), view.grid[axis]
    if pieces < tasks:
        raise view.error(f"grid axis {axis} ({tasks} tasks) is larger than the {pieces} pieces "
                         f"of {align} that dim {dim} (size {tensor.shape[dim]}) of tensor "
                         f"'{tensor.name}' (operand {operand!r}) can be cut into")
    if pieces * tasks >= 1 << 32:  # tasks/common/split.cuh computes the bounds in 32 bits
        raise view.error(f"grid axis {axis} ({tasks} tasks) times the pieces of {align} of dim "
                         f"{dim} of tensor '{tensor.name}' must stay below 2^32")


def _check_partition(view: OpView, task: Any) -> None:
    """Tasks of one op must write disjoint regions: every grid axis of size > 1 splits each output."""
    for spec in task.operands:
        if not spec.access.writes or spec.name not in view.tensors \
                or spec.name in task.disjoint_writes:
            continue
        split = view.splits[spec.name]
        for axis in range(3):
            if view.grid[axis] > 1 and split[axis] is None:
                raise view.error(f"grid axis {axis} ({view.grid[axis]} tasks) does not split "
                                 f"output {spec.name!r}: its tasks would write the same region")


def _check_no_overlap_between_tasks(view: OpView, task: Any) -> None:
    """Tasks of one op run in any order, so no task may touch what another task of the same op
    writes (e.g. reading all of a tensor while tiles of it are overwritten in place)."""
    written = {view.tensors[s.name].name for s in task.operands
               if s.access.writes and s.name in view.tensors}
    points = grid_points(view.grid)
    for tensor in written:
        operands = [name for name, t in view.tensors.items() if t.name == tensor]
        if len(operands) < 2:
            continue
        boxes = {o: np.array([task.region(view, o, p) for p in points]) for o in operands}
        for a in operands:
            if not task.operand(a).access.writes or a in task.disjoint_writes:
                continue
            for b in operands:
                hit = boxes_overlap(boxes[b], boxes[a])
                np.fill_diagonal(hit, False)
                if hit.any():
                    raise view.error(f"operand {a!r} writes tensor '{tensor}' where another task "
                                     f"of the same layer accesses it through {b!r}; write to a "
                                     f"separate tensor")
