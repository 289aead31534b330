"""compile_graph: Graph -> Plan. Runs the passes in order: fuse, tile, deps, counters, schedule,
records, deadlock check, arena placement."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

import numpy as np

from mpk.compiler import record
from mpk.compiler.counters import CounterPlan, assign_counters
from mpk.compiler.deps import find_edges
from mpk.compiler.flags import Flags, counted_edges, flagged_tensors, plan_flags
from mpk.compiler.fuse import fuse
from mpk.compiler.plan import Plan, PlanOp, PlanStream, PlanTensor
from mpk.compiler.schedule import CostModel, Schedule, schedule_tasks
from mpk.compiler.simulate import check_deadlock_free
from mpk.compiler.tiling import TiledOp, tile_graph
from mpk.errors import CompileError
from mpk.graph.graph import DEFAULT_NUM_SMS, Graph
from mpk.tasks.base import PAGE_BYTES, StreamLayout
from mpk.tensors import Role

ARENA_ALIGN = 256
# Plan.scratch_bytes granularity. A backend sizes its buffers from it (the CUDA runtime gives a
# task whatever its weight pages leave, so its build depends on the page count alone).
SCRATCH_ROUND = 1024


def compile_graph(graph: Graph, num_sms: int = DEFAULT_NUM_SMS, *, fuse_ops: bool = True,
                  cost_model: CostModel = CostModel()) -> Plan:
    t0 = time.perf_counter()
    if num_sms <= 0:
        raise CompileError(f"num_sms must be positive, got {num_sms}")
    if not graph.ops:
        raise CompileError("the graph has no layers")
    if fuse_ops:
        graph = fuse(graph)
    ops = tile_graph(graph)
    shapes = {name: t.shape for name, t in graph.tensors.items()}
    edges = find_edges(ops, shapes)
    flagged = flagged_tensors(graph, ops)
    counters = assign_counters([op.num_tasks for op in ops], edges,
                               counted_edges(ops, edges, flagged))
    costs = [op.kind.cost(op.view) for op in ops for _ in range(op.num_tasks)]
    sched = schedule_tasks(costs, counters.waits, counters.signals, num_sms, cost_model)
    layouts = {op.index: op.kind.stream_layout(op.view) for op in ops}
    flags = plan_flags(ops, counters, flagged)
    tensors, tensor_ids, arena = _tensor_table(graph, ops, flags.tensors)
    streams = tuple(PlanStream(op.index, layouts[op.index].total_bytes) for op in ops
                    if layouts[op.index] is not None)
    stream_ids = {s.op: len(tensors) + i for i, s in enumerate(streams)}
    kinds = tuple(sorted({op.op.kind for op in ops}))
    instrs, lengths = _records(ops, counters, sched, tensor_ids, kinds, graph, num_sms, layouts,
                               stream_ids, flags)
    check_deadlock_free(instrs, lengths, len(counters.counts))
    counts, arrivals = _arrival_counters(ops, counters.counts)
    plan = Plan(
        num_sms=num_sms, kinds=kinds, tensors=tensors,
        ops=tuple(_plan_op(op, tensor_ids) for op in ops),
        op_params=_op_params(ops, flags, arrivals), instrs=instrs, lengths=lengths,
        counter_counts=np.array(counts, dtype=np.int32), arena_bytes=arena,
        scratch_bytes=_scratch_bytes(ops), streams=streams,
        constants=_cuda_constants(ops, flags.tensors),
    )
    plan.meta.update(_stats(ops, counters, sched, plan, costs, cost_model))
    plan.meta["compile_s"] = round(time.perf_counter() - t0, 3)
    return plan


def _tensor_table(graph: Graph, ops: list[TiledOp], flagged: frozenset[str]
                  ) -> tuple[tuple[PlanTensor, ...], dict[str, int], int]:
    used = {acc.tensor for op in ops for acc in op.accesses}
    table, ids, offset = [], {}, 0
    for name, spec in graph.tensors.items():
        if name not in used:
            continue
        entry = PlanTensor(name, spec.shape, spec.dtype.value, spec.role.value, -1,
                           name in flagged)
        if spec.role is Role.ACTIVATION:
            entry = replace(entry, offset=offset)
            offset += -(-entry.device_nbytes // ARENA_ALIGN) * ARENA_ALIGN
        ids[name] = len(table)
        table.append(entry)
    return tuple(table), ids, offset


def _plan_op(op: TiledOp, tensor_ids: dict[str, int]) -> PlanOp:
    return PlanOp(op.op.name, op.op.kind, op.op.grid,
                  tuple((acc.operand, tensor_ids[acc.tensor]) for acc in op.accesses),
                  tuple(op.op.splits), tuple(op.op.attrs), op.first_task)


def _cuda_constants(ops: list[TiledOp], flagged: frozenset[str]) -> tuple[tuple[str, int], ...]:
    values: dict[str, int] = {}
    for op in ops:
        operands = frozenset(acc.operand for acc in op.accesses if acc.tensor in flagged)
        for name, value in op.kind.cuda_constants(op.view, operands).items():
            values[name] = max(values.get(name, value), value)
    return tuple(sorted(values.items()))


def _scratch_bytes(ops: list[TiledOp]) -> int:
    need = max((op.kind.scratch_bytes(op.view) for op in ops), default=0)
    return max(SCRATCH_ROUND, -(-need // SCRATCH_ROUND) * SCRATCH_ROUND)


def _arrival_counters(ops: list[TiledOp], counts: list[int]
                      ) -> tuple[list[int], dict[int, int]]:
    """The dependency counters' counts followed by each op's arrival counters (TaskKind.arrivals:
    one per group, counting the group's tasks, which add all or none in a step), and the first
    arrival counter of each op that has them."""
    counts, first = list(counts), {}
    for op in ops:
        arrivals = op.kind.arrivals(op.view)
        if arrivals is not None:
            groups, per_group = arrivals
            first[op.index] = len(counts)
            counts.extend([per_group] * groups)
    return counts, first


def _op_params(ops: list[TiledOp], flags: Flags, arrivals: dict[int, int]) -> np.ndarray:
    table = np.zeros((len(ops), record.PARAM_WORDS), dtype=np.int32)
    for i, op in enumerate(ops):
        words = op.kind.param_words(op.view)
        if len(words) > record.KIND_PARAMS:
            raise AssertionError(f"{op.kind.name} has more than {record.KIND_PARAMS} params")
        table[i, : len(words)] = words
        table[i, record.ARRIVALS_PARAM] = arrivals.get(op.index, -1)
        table[i, record.FLAG_PARAMS:] = flags.entries.get(op.index, (0,) * record.FLAG_ENTRIES)
    return table


def _records(ops: list[TiledOp], counters: CounterPlan, sched: Schedule,
             tensor_ids: dict[str, int], kinds: tuple[str, ...], graph: Graph,
             num_sms: int, layouts: dict[int, StreamLayout | None], stream_ids: dict[int, int],
             flags: Flags) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.bincount(sched.sm_of_task, minlength=num_sms).astype(np.int32)
    instrs = np.full((num_sms, max(int(lengths.max()), 1), record.WORDS), 0, dtype=np.int32)
    fill = np.zeros(num_sms, dtype=np.int64)
    for op in ops:
        kind_id = kinds.index(op.op.kind)
        slots = {spec.name: i for i, spec in enumerate(op.kind.operands)}
        for local in range(op.num_tasks):
            task = op.first_task + local
            rec = _record_of(op, local, task, kind_id, slots, counters, tensor_ids, graph)
            rec[record.POLLED] = flags.polled[task]
            _stream_fields(rec, layouts[op.index], local, stream_ids.get(op.index, -1))
            sm = int(sched.sm_of_task[task])
            instrs[sm, fill[sm]] = rec
            fill[sm] += 1
    return instrs, lengths


def _record_of(op: TiledOp, local: int, task: int, kind_id: int, slots: dict[str, int],
               counters: CounterPlan, tensor_ids: dict[str, int], graph: Graph) -> np.ndarray:
    rec = np.zeros(record.WORDS, dtype=np.int64)
    rec[record.KIND], rec[record.OP], rec[record.TASK] = kind_id, op.index, task
    waits = counters.waits[task]
    rec[record.NUM_WAITS] = len(waits)
    for w, (c, count, prev) in enumerate(waits):
        base = record.WAITS + record.WAIT_STRIDE * w
        rec[base: base + record.WAIT_STRIDE] = (c, count, int(prev))
    signals = counters.signals[task]
    rec[record.NUM_SIGNALS] = len(signals)
    rec[record.SIGNALS: record.SIGNALS + len(signals)] = signals
    rec[record.POINT: record.POINT + 3] = op.points[local]
    rec[record.NUM_OPERANDS] = len(op.kind.operands)
    for s in range(record.MAX_OPERANDS):
        rec[record.OPERANDS + record.OPERAND_STRIDE * s] = -1
    for acc in op.accesses:
        spec = graph.tensors[acc.tensor]
        box = acc.boxes[local]
        first = int(sum(int(lo) * st for (lo, _), st in zip(box, spec.strides())))
        base = record.OPERANDS + record.OPERAND_STRIDE * slots[acc.operand]
        rec[base] = tensor_ids[acc.tensor]
        rec[base + 1: base + 3] = record.split64(first)
    return rec


def _stream_fields(rec: np.ndarray, layout: StreamLayout | None, local: int,
                   tensor_id: int) -> None:
    rec[record.STREAM] = -1
    if layout is None:
        return
    runs = layout.runs[local]
    if len(runs) > record.MAX_RUNS:
        raise AssertionError(f"a task stream has {len(runs)} runs; records hold "
                             f"{record.MAX_RUNS}")
    rec[record.STREAM] = tensor_id
    rec[record.STREAM_OFFSET: record.STREAM_OFFSET + 2] = record.split64(layout.offsets[local])
    for r, (count, nbytes) in enumerate(runs):
        if nbytes % 16 or not 0 < nbytes <= PAGE_BYTES or count <= 0:
            raise AssertionError(f"run of {count} pages of {nbytes} bytes: pages are positive "
                                 f"multiples of 16 bytes up to {PAGE_BYTES}")
        base = record.STREAM_RUNS + record.RUN_STRIDE * r
        rec[base: base + 2] = (count, nbytes)


def _stats(ops: list[TiledOp], counters: CounterPlan, sched: Schedule, plan: Plan,
           costs: list, model: CostModel) -> dict:
    waits_hist = Counter(len(w) for w in counters.waits)
    weight_bytes = sum(c.weight_bytes for c in costs)
    return {
        "num_ops": len(ops),
        "num_tasks": plan.num_tasks,
        "num_counters": plan.num_counters,
        "waits_histogram": {str(k): v for k, v in sorted(waits_hist.items())},
        "tasks_per_kind": dict(Counter(op.op.kind for op in ops for _ in range(op.num_tasks))),
        "ops_per_kind": dict(Counter(op.op.kind for op in ops)),
        "sm_busy_us": {"min": float(sched.busy_us.min()), "mean": float(sched.busy_us.mean()),
                       "max": float(sched.busy_us.max())},
        "predicted_us_per_step": round(sched.makespan_us, 2),
        "weight_bytes_per_step": int(weight_bytes),
        "floor_us_per_step": round(weight_bytes / model.floor_bytes_per_us, 2),
        "arena_bytes": plan.arena_bytes,
    }
