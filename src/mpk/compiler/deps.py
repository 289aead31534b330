"""Dependency analysis: read/write boxes -> task-level edges between ops.

Edges are read-after-write, write-after-read and write-after-write, found by box overlap in
program order. Per tensor we keep only the accesses since the last op that overwrote ALL of it,
so the work is linear in the number of ops (times the tasks of the op pairs that touch a tensor),
never quadratic in the number of tasks of the whole graph.

The decode step repeats, so the ops are walked twice: edges found in the second walk that point
into the first are "previous-step" edges (e.g. the embedding reads the token the previous step's
argmax wrote; a buffer written this step that the previous step still reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mpk.compiler.tiling import Access1, TiledOp, covers_whole
from mpk.tasks.base import boxes_overlap


@dataclass
class Edge:
    """Consumer op `consumer` depends on producer op `producer`: matrix[c, p] for task pairs."""

    producer: int
    consumer: int
    prev: bool  # the producer instance is the previous step's
    matrix: np.ndarray  # bool [consumer tasks, producer tasks]


@dataclass(frozen=True)
class Conflict:
    """One access of op `consumer` that overlaps an earlier one of op `producer` on the same
    tensor (at least one of them writes): matrix[c, p] for task pairs."""

    producer: int
    consumer: int
    prev: bool
    earlier: Access1
    later: Access1
    matrix: np.ndarray  # bool [consumer tasks, producer tasks]


@dataclass
class _History:
    entries: list[tuple[int, bool, Access1]] = field(default_factory=list)  # (op, prev, access)


def find_edges(ops: list[TiledOp], shapes: dict[str, tuple[int, ...]]) -> list[Edge]:
    found: dict[tuple[int, int, bool], np.ndarray] = {}
    for c in find_conflicts(ops, shapes):
        key = (c.producer, c.consumer, c.prev)
        found[key] = found[key] | c.matrix if key in found else c.matrix
    return [Edge(p, c, prev, m) for (p, c, prev), m in found.items()]


def find_conflicts(ops: list[TiledOp], shapes: dict[str, tuple[int, ...]]) -> list[Conflict]:
    """Every access pair an edge comes from, in the order find_edges meets them."""
    history: dict[str, _History] = {}
    found: list[Conflict] = []
    for walk in (0, 1):
        for op in ops:
            for acc in op.accesses:
                _visit(op, acc, history.setdefault(acc.tensor, _History()), walk, found)
            for acc in op.accesses:
                _record(op, acc, history[acc.tensor], walk, shapes[acc.tensor])
        for hist in history.values():  # everything seen in walk 0 is "previous step" in walk 1
            hist.entries = [(o, True, a) for o, _, a in hist.entries]
    return found


def _visit(op: TiledOp, acc: Access1, hist: _History, walk: int, found: list[Conflict]) -> None:
    for producer, prev, pacc in hist.entries:
        if walk == 1 and not prev:
            continue  # same-step edges were all found in the first walk
        if producer == op.index and not prev:
            continue  # tasks of one op never depend on each other
        if not (acc.access.writes or pacc.access.writes):
            continue
        m = boxes_overlap(pacc.boxes, acc.boxes)
        if m.any():
            found.append(Conflict(producer, op.index, prev, pacc, acc, m))


def _record(op: TiledOp, acc: Access1, hist: _History, walk: int,
            shape: tuple[int, ...]) -> None:
    if acc.access.writes and covers_whole(acc.boxes, shape):
        keep = [e for e in hist.entries if e[0] == op.index and not e[1]]
        hist.entries = keep + [(op.index, False, acc)]
    else:
        hist.entries.append((op.index, False, acc))
