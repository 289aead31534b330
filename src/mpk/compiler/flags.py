"""Flagged activations: tensors whose GPU readers poll the data itself instead of a counter.

Through a counter, a producer -> consumer hand-off on the GPU is four dependent trips through L2
after the producer's last store: its release fence waits for the stores, the counter add
travels, the consumer's controller polls it, and only then do the consumer's warps load the
data. When every word of the data carries the epoch of the write that stored it, the consumer
polls the words it loads anyway and starts as soon as the last one lands (NCCL's low-latency
protocol; Mirage's megakernel library picks "data as flag" per edge for the same reason).

Device format (the CPU interpreter keeps plain tensors): a flagged bf16 tensor [..., N] is
stored as u64 words [..., N/2], each a bf16 pair (n even, n + 1) in the low 32 bits and the
epoch of its write in the high 32, written and read as single 64-bit accesses (single-copy
atomic), so a reader never sees a pair without its epoch. A flagged int32 tensor (the router's
expert ids) is stored as words [..., N], one value in the low 32 bits of each. The epoch of write
w (0-based, in program order) of a tensor written W times a step, in global step g, is
(g * W + w) mod 2^31 + 1: never 0 (a zeroed arena) nor 0xFFFFFFFF (a poisoned one).

A tensor is flagged when it is an ACTIVATION of at most FLAG_MAX_BYTES, bf16 with an even last
dim or int32, every op that touches it does so through an operand its kind lists in
TaskKind.flag_operands (pure reads or pure writes), every write covers the whole tensor, and
every read follows a write of the same step.

The CUDA controller skips a same-step wait (record.POLLED) of consumer task r on counter c of
producer op P when r, by polling, sees every word that each task signalling c wrote (each such
task's flagged writes lie inside r's flagged reads: r reads all of a tensor, or, like attention
reading its KV head's columns of qkv, exactly the pieces its counter counts). Seeing all of a
task's writes then says what c's count says: that task finished. That holds for P's flagged writes;
P's plain writes (attention's KV-cache append beside its flagged output) are not ordered by the
words r sees, so every task that conflicts with them keeps its own counted wait on P
(counted_edges: the counter reduction may not drop it; for the append, the next step's
attention waits on this step's, long since done) and r must not touch them; r's other
conflicts with P may only be writes to what the counted tasks read (a flagged write is computed
from its task's reads of whole inputs, flag_operands' contract). Waits the transitive reduction
dropped because c implied them stay ordered the same way: each counted task ran after its own
waits were met, and r acts only after seeing all of its writes. The exception is a task that in
some step touches no activation at all (attention's splits that a short row does not use:
tasks/attention): it polls nothing and writes nothing, so r may act before it ends, and nothing
it could conflict with is ordered through it (its counter still counts it for counted waits). A
task that reads any flagged tensor has record.POLLS set: the CUDA storer watches it (a poll that
never sees its epoch is reported). The records keep every wait: the interpreter, the deadlock
simulation and the mutation tests see the same dependencies as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpk.compiler import record
from mpk.compiler.counters import CounterPlan
from mpk.compiler.deps import Edge
from mpk.compiler.tiling import Access1, TiledOp, covers_whole
from mpk.dtypes import DType
from mpk.graph.graph import Graph
from mpk.tasks.base import FLAG_MAX_BYTES, Access, boxes_overlap
from mpk.tensors import Role

_MAX_WRITES = 1 << 11  # W takes 12 bits of an entry, w the 11 below its sign bit


@dataclass(frozen=True)
class Flags:
    tensors: frozenset[str]
    entries: dict[int, tuple[int, ...]]  # op index -> its FLAG_ENTRIES param words
    polled: list[int]  # per global task: its record.POLLED mask


def encode_entry(slot: int, writes: int, index: int) -> int:
    """One flag entry: operand slot (+1, so 0 is "unused"), W writes a step, this write's w."""
    if not (0 <= slot < 255 and 0 < writes < _MAX_WRITES and 0 <= index < writes):
        raise AssertionError(f"flag entry out of range: slot {slot}, W {writes}, w {index}")
    return (slot + 1) | (writes << 8) | (index << 20)


def decode_entry(entry: int) -> tuple[int, int, int] | None:
    """(operand slot, W, w) of a flag entry, or None for an unused one."""
    entry &= 0xFFFFFFFF
    if not entry:
        return None
    return (entry & 0xFF) - 1, (entry >> 8) & 0xFFF, entry >> 20


def epoch(entry: int, step: int) -> int:
    """The epoch a flagged access of `entry` writes or expects in global step `step`."""
    decoded = decode_entry(entry)
    if decoded is None:
        raise ValueError("an unused flag entry has no epoch")
    _, writes, index = decoded
    return (step * writes + index) % (1 << 31) + 1


def words_per_row(dtype: DType, last_dim: int) -> int:
    """u64 words of one row (last dim) of a flagged tensor: bf16 pairs, or one int32 each."""
    return last_dim if dtype is DType.I32 else last_dim // 2


def flagged_tensors(graph: Graph, ops: list[TiledOp]) -> frozenset[str]:
    capable = {op.index: op.kind.flag_operands(op.view) for op in ops}
    return _flagged_tensors(graph, ops, capable)


def counted_edges(ops: list[TiledOp], edges: list[Edge], tensors: frozenset[str]
                  ) -> frozenset[tuple[int, int, bool]]:
    """(producer, consumer, prev) edges whose waits the counter reduction keeps: from an op that
    writes flagged and plain tensors to each op that conflicts with its plain writes. A poller
    of its flagged output may skip counting it (module doc); these tasks still count it."""
    keep = set()
    for e in edges:
        producer, consumer = ops[e.producer], ops[e.consumer]
        if not _mixed(producer, tensors):
            continue
        plain = [a for a in producer.accesses if a.access.writes and a.tensor not in tensors]
        if any(a.tensor == b.tensor and boxes_overlap(a.boxes, b.boxes).any()
               for a in plain for b in consumer.accesses):
            keep.add((e.producer, e.consumer, e.prev))
    return frozenset(keep)


def plan_flags(ops: list[TiledOp], counters: CounterPlan, tensors: frozenset[str]) -> Flags:
    return Flags(tensors, _entries(ops, tensors), _polled(ops, counters, tensors))


def _mixed(op: TiledOp, tensors: frozenset[str]) -> bool:
    """Does `op` write both flagged and plain tensors?"""
    flagged = {a.tensor in tensors for a in op.accesses if a.access.writes}
    return flagged == {True, False}


def _polls(op: TiledOp, tensors: frozenset[str]) -> bool:
    return any(acc.tensor in tensors and acc.access.reads for acc in op.accesses)


def _flagged_tensors(graph: Graph, ops: list[TiledOp],
                     capable: dict[int, frozenset[str]]) -> frozenset[str]:
    accessors: dict[str, list[tuple[TiledOp, Access1]]] = {}
    for op in ops:
        for acc in op.accesses:
            accessors.setdefault(acc.tensor, []).append((op, acc))
    chosen = set()
    for name, accs in accessors.items():
        spec = graph.tensors[name]
        if spec.role is not Role.ACTIVATION or spec.nbytes > FLAG_MAX_BYTES or not (
                (spec.dtype is DType.BF16 and spec.shape[-1] % 2 == 0)
                or spec.dtype is DType.I32):
            continue
        if any(acc.operand not in capable[op.index] or acc.access is Access.READ_WRITE
               for op, acc in accs):
            continue
        writers = [op.index for op, acc in accs if acc.access.writes]
        if not writers or len(writers) >= _MAX_WRITES:
            continue
        if not all(covers_whole(acc.boxes, spec.shape) for _, acc in accs if acc.access.writes):
            continue
        if all(any(w < op.index for w in writers) for op, acc in accs if acc.access.reads):
            chosen.add(name)
    return frozenset(chosen)


def _entries(ops: list[TiledOp], tensors: frozenset[str]) -> dict[int, tuple[int, ...]]:
    writers: dict[str, list[int]] = {}
    for op in ops:
        for acc in op.accesses:
            if acc.tensor in tensors and acc.access.writes:
                writers.setdefault(acc.tensor, []).append(op.index)
    entries: dict[int, tuple[int, ...]] = {}
    for op in ops:
        words = []
        for acc in op.accesses:
            if acc.tensor not in tensors:
                continue
            w = writers[acc.tensor]
            # A read sees the last write before this op (an op that reads and writes a tensor
            # through two operands, the in-place residual, reads the previous write).
            index = w.index(op.index) if acc.access.writes else max(
                i for i, o in enumerate(w) if o < op.index)
            slot = [s.name for s in op.kind.operands].index(acc.operand)
            words.append(encode_entry(slot, len(w), index))
        if len(words) > record.FLAG_ENTRIES:
            raise AssertionError(f"op {op.op.name} has {len(words)} flagged operands; params "
                                 f"hold {record.FLAG_ENTRIES}")
        if words:
            entries[op.index] = tuple(words + [0] * (record.FLAG_ENTRIES - len(words)))
    return entries


def _polled(ops: list[TiledOp], counters: CounterPlan, tensors: frozenset[str]) -> list[int]:
    owner: dict[int, int] = {}  # counter -> producer op
    members: dict[int, list[int]] = {}  # counter -> its producers' local task indices
    op_of_task: list[int] = []
    for op in ops:
        for local in range(op.num_tasks):
            for c in counters.signals[op.first_task + local]:
                owner[c] = op.index
                members.setdefault(c, []).append(local)
            op_of_task.append(op.index)
    skippable: dict[tuple[int, int], np.ndarray] = {}
    polled = []
    for task, waits in enumerate(counters.waits):
        consumer = ops[op_of_task[task]]
        mask = record.POLLS if _polls(consumer, tensors) else 0
        for w, (c, _count, prev) in enumerate(waits):
            producer = ops[owner[c]]
            if prev or producer.index == consumer.index:
                continue
            key = (consumer.index, c)
            if key not in skippable:
                skippable[key] = _skippable(producer, np.array(members[c]), consumer, tensors)
            if skippable[key][task - consumer.first_task]:
                mask |= 1 << w
        polled.append(mask)
    return polled


def _skippable(producer: TiledOp, counted: np.ndarray, consumer: TiledOp,
               tensors: frozenset[str]) -> np.ndarray:
    """bool per consumer task: may it skip a wait on the counter of `producer`'s tasks `counted`
    (local indices) because it sees all their writes (module doc)?"""
    none = np.zeros(consumer.num_tasks, dtype=bool)
    plain_writes = any(ap.access.writes and ap.tensor not in tensors for ap in producer.accesses)
    if plain_writes and not _mixed(producer, tensors):  # counted_edges keeps mixed ops' waits
        return none
    sees = np.ones((consumer.num_tasks, len(counted)), dtype=bool)
    wrote = np.zeros(len(counted), dtype=bool)
    uncounted = np.ones(producer.num_tasks, dtype=bool)
    uncounted[counted] = False
    bad = none.copy()
    for ap in producer.accesses:
        mine = ap.boxes[counted]
        if ap.access.writes and ap.tensor in tensors:
            written = (mine[..., 1] > mine[..., 0]).all(axis=-1)  # [counted]
            inside = np.zeros_like(sees)
            for ac in consumer.accesses:
                if ac.tensor == ap.tensor and ac.access is Access.READ:
                    inside |= _contains(ac.boxes, mine)
            sees &= inside | ~written[None]
            wrote |= written
        for ac in consumer.accesses:
            if ap.tensor != ac.tensor or not (ap.access.writes or ac.access.writes):
                continue
            if ap.tensor in tensors and ap.access is Access.WRITE and ac.access is Access.READ:
                continue  # the polled words: `sees`
            if ap.access is Access.READ and ac.access.writes:
                # a write over what uncounted tasks read: not ordered here
                bad |= (boxes_overlap(ap.boxes, ac.boxes) & uncounted[None]).any(axis=1)
            else:
                bad |= boxes_overlap(ap.boxes, ac.boxes).any(axis=1)
    return ~bad & sees.all(axis=1) & bool(wrote.all())


def _contains(outer: np.ndarray, inner: np.ndarray) -> np.ndarray:
    """bool [len(outer), len(inner)]: does box outer[i] contain box inner[j]?"""
    lo = outer[:, None, :, 0] <= inner[None, :, :, 0]
    hi = inner[None, :, :, 1] <= outer[:, None, :, 1]
    return np.all(lo & hi, axis=-1)
