"""Dependency completeness: dropping ANY single wait of a small model's Plan is caught.

For each wait (consumer task, counter) we remove it and run the interpreter in the free order
with an adversarial priority: the victim runs as early as its other waits allow, the producers
of the dropped counter as late as possible. Activations start poisoned. The run must differ from
the unmutated one (or fail). A wait that no order can expose would be a redundant wait the
compiler should have removed, so this also checks the transitive reduction. The exception is
by design: a wait of a kept edge (compiler/flags.counted_edges) is implied through a wait the
GPU skips because it polls the data instead; the interpreter counts that one, so dropping the
kept wait cannot show here (tests/compiler/test_flags.py checks those waits exist).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mpk.compiler import flags, record
from mpk.compiler.deps import find_edges
from mpk.compiler.fuse import fuse
from mpk.compiler.tiling import tile_graph
from mpk.compiler.plan import Plan
from mpk.engine.bind import bind_model
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import get_preset
from mpk.models.weights import random_weights
from tests.interp.model_run import executor, make_plan

SHAPE = DecodeShape(batch=2, steps_per_launch=2, page_size=4, max_pages=2, num_pages=4)
STEPS = 2


def _run(plan: Plan, cfg, weights, seed: int, priority=None,
         order_seed: int = 0) -> dict[str, torch.Tensor] | None:
    ex = executor(plan, order="free", seed=order_seed, priority=priority)
    bind_model(ex, ex.plan, cfg, SHAPE, weights, seed)
    ex.write("prompt", torch.tensor([[3, 7], [-1, 5]], dtype=torch.int32))
    try:
        ex.run(STEPS)
    except (IndexError, RuntimeError):
        return None  # the mutation made the run fail: caught
    return {t.name: ex.read(t.name) for t in plan.tensors if t.role != "weight"}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].nan_to_num(7.0), b[k].nan_to_num(7.0)) for k in a)


def _kept_edges(cfg, num_sms: int) -> frozenset[tuple[int, int, bool]]:
    graph = fuse(build_graph(cfg, SHAPE, num_sms=num_sms))
    ops = tile_graph(graph)
    edges = find_edges(ops, {n: t.shape for n, t in graph.tensors.items()})
    return flags.counted_edges(ops, edges, flags.flagged_tensors(graph, ops))


def _drop_wait(plan: Plan, sm: int, index: int, w: int) -> Plan:
    instrs = plan.instrs.copy()
    rec = instrs[sm, index]
    waits = record.decode_waits(rec)
    del waits[w]
    stride = record.WAIT_STRIDE
    rec[record.WAITS: record.WAITS + stride * record.MAX_WAITS] = 0
    for i, triple in enumerate(waits):
        rec[record.WAITS + stride * i: record.WAITS + stride * (i + 1)] = triple
    rec[record.NUM_WAITS] = len(waits)
    return dataclasses.replace(plan, instrs=instrs)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_dropping_any_wait_is_detected(preset: str) -> None:
    """tiny-qwen3-moe adds the MoE kinds' waits (router -> experts' gate_up -> experts' down,
    whose ids and weights come from the router) and a dense layer between MoE layers."""
    cfg = get_preset(preset)
    seed = 7919  # fixed: CI is deterministic
    weights = random_weights(cfg, seed=seed)
    plan = make_plan(cfg, SHAPE, num_sms=8)
    baseline = _run(plan, cfg, weights, seed)
    assert baseline is not None
    assert _same(baseline, _run(plan, cfg, weights, seed, order_seed=1))  # order does not matter
    records = plan.records()
    producers = {c: set() for c in range(plan.num_counters)}
    producer_op = {}
    for rec in records:
        for c in record.decode_signals(rec):
            producers[c].add(int(rec[record.TASK]))
            producer_op[c] = int(rec[record.OP])
    kept = _kept_edges(cfg, num_sms=8)
    undetected, total, exempt = [], 0, 0
    for sm in range(plan.num_sms):
        for index in range(int(plan.lengths[sm])):
            rec = plan.instrs[sm, index]
            for w, (counter, _, prev) in enumerate(record.decode_waits(rec)):
                if (producer_op[counter], int(rec[record.OP]), bool(prev)) in kept:
                    exempt += 1
                    continue
                total += 1
                victim = int(rec[record.TASK])
                late = producers[counter]
                rng = np.random.default_rng(total)

                def priority(t: int) -> float:
                    return 0.0 if t == victim else (2.0 if t in late else 1.0) + rng.random()

                mutated = _run(_drop_wait(plan, sm, index, w), cfg, weights, seed, priority)
                if mutated is not None and _same(baseline, mutated):
                    undetected.append(f"{plan.task_name(victim)} wait on counter {counter}")
    assert total > 50 and exempt <= total // 8
    assert not undetected, f"{len(undetected)}/{total} dropped waits went unnoticed: {undetected}"
