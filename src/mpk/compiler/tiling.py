"""Tiling: every op becomes one task per grid point, each with the box it touches in each operand.

Task order inside an op: grid axis 0 fastest, then axis 1, then axis 2. Boxes are numpy arrays
[num_tasks, ndim, 2] of half-open [lo, hi) ranges, so overlap tests are vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpk.graph.graph import Graph, Op
from mpk.tasks.base import Access, OpView, TaskKind, grid_points
from mpk.tasks.registry import get_kind


@dataclass(frozen=True)
class Access1:
    """One operand of a tiled op: which tensor, how it is accessed, the box of every task."""

    operand: str
    tensor: str
    access: Access
    weight: bool
    boxes: np.ndarray  # int64 [num_tasks, ndim, 2]


@dataclass(frozen=True)
class TiledOp:
    index: int
    op: Op
    view: OpView
    kind: TaskKind
    first_task: int
    points: np.ndarray  # int32 [num_tasks, 3]
    accesses: tuple[Access1, ...]

    @property
    def num_tasks(self) -> int:
        return len(self.points)


def tile_graph(graph: Graph) -> list[TiledOp]:
    tiled: list[TiledOp] = []
    first = 0
    for index, op in enumerate(graph.ops):
        view = graph.view(op)
        kind = get_kind(op.kind)
        points = np.array(grid_points(op.grid), dtype=np.int32)
        accesses = tuple(_access(kind, view, spec.name, points)
                         for spec in kind.operands if spec.name in view.tensors)
        tiled.append(TiledOp(index, op, view, kind, first, points, accesses))
        first += len(points)
    return tiled


def _access(kind: TaskKind, view: OpView, operand: str, points: np.ndarray) -> Access1:
    spec = kind.operand(operand)
    boxes = np.array([kind.region(view, operand, tuple(int(x) for x in p)) for p in points],
                     dtype=np.int64).reshape(len(points), len(view.shape(operand)), 2)
    return Access1(operand, view.tensors[operand].name, spec.access, spec.weight, boxes)


def covers_whole(boxes: np.ndarray, shape: tuple[int, ...]) -> bool:
    """Do the boxes of one op's writes cover the whole tensor? Boxes are disjoint or equal
    (tasks that share an output box, as attention's KV splits share out, where one split writes
    it: TaskKind.disjoint_writes); each distinct box counts once."""
    distinct = np.unique(boxes.reshape(len(boxes), -1), axis=0).reshape(-1, *boxes.shape[1:])
    volume = np.prod(distinct[:, :, 1] - distinct[:, :, 0], axis=1).sum()
    return int(volume) == int(np.prod(shape))
