"""Counters: task-level edges -> per-task waits and signals.

A counter counts completions of a fixed set of producer tasks (per step). For each producer op we
split its tasks into "pieces": the coarsest partition such that every partial consumer set is a
union of pieces (e.g. the QKV tiles of one KV head). Consumers that need the whole op, or many
pieces, wait on the op's "total" counter instead. A task therefore signals at most two counters
(its piece and the total). Redundant waits (implied by another wait of the same task through the
producers' own waits) are removed, except those of `kept` edges (compiler/flags.py: a wait
whose implying path may be polled instead of counted). A task with more than MAX_WAITS waits gets its piece waits
coarsened to totals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mpk.compiler.deps import Edge
from mpk.compiler.record import MAX_WAITS

MAX_PIECES_PER_WAIT = 2

Wait = tuple[int, bool]  # (counter id, previous step)


@dataclass
class OpCounters:
    num_tasks: int
    piece_of_task: np.ndarray  # int [num_tasks], -1 = in no piece
    piece_counter: list[int] = field(default_factory=list)
    total_counter: int | None = None


@dataclass
class CounterPlan:
    counts: list[int]  # tasks signalling each counter, per step
    waits: list[list[tuple[int, int, bool]]]  # per global task: (counter, count, prev)
    signals: list[list[int]]  # per global task


def assign_counters(num_tasks_per_op: list[int], edges: list[Edge],
                    kept: frozenset[tuple[int, int, bool]] = frozenset()) -> CounterPlan:
    first = np.concatenate([[0], np.cumsum(num_tasks_per_op)]).astype(int)
    by_producer: dict[int, list[Edge]] = {}
    for e in edges:
        by_producer.setdefault(e.producer, []).append(e)
    forced_total: set[int] = set()
    while True:
        ops = _make_counters(num_tasks_per_op, by_producer, forced_total)
        waits, keep = _task_waits(num_tasks_per_op, first, edges, ops, kept)
        signals, counts, producers = _signals(num_tasks_per_op, first, ops)
        waits = _reduce(waits, producers, len(counts), _complete_groups(ops), keep)
        crowded = _crowded_producers(waits, ops)
        if not crowded - forced_total:
            break
        forced_total |= crowded
    return CounterPlan(counts, [[(c, counts[c], prev) for c, prev in w] for w in waits],
                       signals)


def _make_counters(sizes: list[int], by_producer: dict[int, list[Edge]],
                   forced_total: set[int]) -> list[OpCounters]:
    ops: list[OpCounters] = []
    next_id = 0
    for index, n in enumerate(sizes):
        oc = OpCounters(n, np.full(n, -1, dtype=np.int64))
        partial, needs_total = [], index in forced_total
        for e in by_producer.get(index, []):
            for row in np.unique(e.matrix, axis=0):
                # Previous-step edges are almost always implied by the step chain (the next
                # embedding waits on the last argmax); give them the coarse total counter so
                # they do not fragment the pieces that same-step consumers need.
                if row.all() or index in forced_total or e.prev:
                    needs_total = True
                elif row.any():
                    partial.append(row)
        if partial:
            sig = np.stack(partial, axis=1)  # [n, num sets]
            keys, piece = np.unique(sig, axis=0, return_inverse=True)
            piece = piece.reshape(-1)
            member = keys.any(axis=1)
            remap = {p: i for i, p in enumerate(sorted({int(p) for p in piece if member[p]}))}
            oc.piece_of_task = np.array([remap.get(int(p), -1) for p in piece], dtype=np.int64)
            oc.piece_counter = list(range(next_id, next_id + len(remap)))
            next_id += len(remap)
            needs_total = needs_total or any(
                len(np.unique(oc.piece_of_task[row])) > MAX_PIECES_PER_WAIT for row in partial)
        if needs_total:
            oc.total_counter = next_id
            next_id += 1
        ops.append(oc)
    return ops


def _task_waits(sizes: list[int], first: np.ndarray, edges: list[Edge], ops: list[OpCounters],
                kept: frozenset[tuple[int, int, bool]]
                ) -> tuple[list[list[Wait]], list[set[Wait]]]:
    """Each task's waits, and those of them that come from kept edges."""
    waits: list[list[Wait]] = [[] for _ in range(int(first[-1]))]
    keep: list[set[Wait]] = [set() for _ in waits]
    for e in edges:
        oc = ops[e.producer]
        for r in range(e.matrix.shape[0]):
            row = e.matrix[r]
            if not row.any():
                continue
            pieces = sorted({int(p) for p in oc.piece_of_task[row]})
            use_total = (e.prev or row.all() or -1 in pieces
                         or len(pieces) > MAX_PIECES_PER_WAIT)
            task = int(first[e.consumer]) + r
            new = [(_total(oc), e.prev)] if use_total else [
                (oc.piece_counter[p], e.prev) for p in pieces]
            waits[task].extend(new)
            if (e.producer, e.consumer, e.prev) in kept:
                keep[task].update(new)
    return [sorted(set(w)) for w in waits], keep


def _total(oc: OpCounters) -> int:
    if oc.total_counter is None:
        raise AssertionError("a consumer needs a total counter the producer op lacks")
    return oc.total_counter


def _signals(sizes: list[int], first: np.ndarray,
             ops: list[OpCounters]) -> tuple[list[list[int]], list[int], list[list[int]]]:
    num_counters = 1 + max([c for oc in ops for c in oc.piece_counter]
                           + [oc.total_counter for oc in ops if oc.total_counter is not None]
                           + [-1])
    counts = [0] * num_counters
    producers: list[list[int]] = [[] for _ in range(num_counters)]
    signals: list[list[int]] = []
    for index, oc in enumerate(ops):
        for t in range(oc.num_tasks):
            sig = []
            if oc.piece_of_task[t] >= 0:
                sig.append(oc.piece_counter[oc.piece_of_task[t]])
            if oc.total_counter is not None:
                sig.append(oc.total_counter)
            for c in sig:
                counts[c] += 1
                producers[c].append(int(first[index]) + t)
            signals.append(sig)
    return signals, counts, producers


def _complete_groups(ops: list[OpCounters]) -> list[tuple[int, int, bool]]:
    """(total counter, mask of its piece counters, do the pieces cover every task) per op with
    both: a total implies its pieces; pieces that cover every task imply the total."""
    groups = []
    for oc in ops:
        if oc.total_counter is not None and oc.piece_counter:
            mask = sum(1 << c for c in oc.piece_counter)
            groups.append((oc.total_counter, mask, bool((oc.piece_of_task >= 0).all())))
    return groups


def _reduce(waits: list[list[Wait]], producers: list[list[int]], num_counters: int,
            groups: list[tuple[int, int, bool]], keep: list[set[Wait]]) -> list[list[Wait]]:
    """Drop waits implied by another wait of the same task (transitive reduction), but not the
    task's `keep` waits."""
    cur_mask = (1 << num_counters) - 1
    implied = [0] * num_counters
    piece_masks = {total: mask for total, mask, _ in groups}  # a total implies its pieces
    groups = [(total, mask) for total, mask, whole in groups if whole]

    def complete(x: int) -> int:
        for total, mask in groups:
            if x & mask == mask:
                x |= 1 << total
            if (x >> num_counters) & mask == mask:
                x |= 1 << (total + num_counters)
        return x

    def closure(w: Wait) -> int:
        c, prev = w
        if prev:
            return (1 << (c + num_counters)) | ((implied[c] & cur_mask) << num_counters)
        return (1 << c) | implied[c]

    for _ in range(2):  # second pass sees previous-step closures computed in the first
        for c in range(num_counters):
            acc = 0
            for t in producers[c]:
                for w in waits[t]:
                    acc |= closure(w)
            implied[c] = complete(acc) | piece_masks.get(c, 0)
    if not _steps_chain(waits, producers, num_counters, closure):
        raise AssertionError("a counter's producers could run a step ahead of each other")
    out: list[list[Wait]] = []
    for w, must in zip(waits, keep):
        left = list(w)
        for cand in list(left):
            bit = 1 << (cand[0] + (num_counters if cand[1] else 0))
            if cand not in must and any(o != cand and closure(o) & bit for o in left):
                left.remove(cand)
        out.append(left)
    return out


def _steps_chain(waits: list[list[Wait]], producers: list[list[int]], num_counters: int,
                 closure: Callable[[Wait], int]) -> bool:
    """Counting completions proves "all producers finished step g" only if no producer can
    finish step g+1 first: each producer of a shared counter must (transitively) wait for that
    counter's previous step before it runs again. Every in-step edge A -> B has a mirror edge
    B(g) -> A(g+1) (A rewrites what B read, or B's writes are read/overwritten by A), so this
    holds by construction; it is checked because the monotonic-counter protocol rests on it."""
    for c, tasks in enumerate(producers):
        if len(tasks) < 2:
            continue  # one producer: its instances run in order on one SM
        for t in tasks:
            reach = 0
            for w in waits[t]:
                reach |= closure(w)
            if not reach >> (c + num_counters) & 1:
                return False
    return True


def _crowded_producers(waits: list[list[Wait]], ops: list[OpCounters]) -> set[int]:
    """Producer ops whose pieces push some task over MAX_WAITS: they switch to a total."""
    owner = {}
    for index, oc in enumerate(ops):
        for c in oc.piece_counter:
            owner[c] = index
    crowded: set[int] = set()
    for w in waits:
        if len(w) > MAX_WAITS:
            counts: dict[int, int] = {}
            for c, _ in w:
                if c in owner:
                    counts[owner[c]] = counts.get(owner[c], 0) + 1
            if not counts:
                raise AssertionError(f"a task needs {len(w)} waits on distinct ops")
            crowded.add(max(counts, key=counts.__getitem__))
    return crowded
