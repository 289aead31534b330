"""One Plan and one weight set per rank of a tensor-parallel model."""

from __future__ import annotations

from mpk.compiler.lower import compile_graph
from mpk.compiler.plan import Plan
from mpk.graph.graph import DEFAULT_NUM_SMS
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import ModelConfig
from mpk.parallel.tp import TensorParallel


def rank_plans(cfg: ModelConfig, shape: DecodeShape, size: int, num_sms: int = DEFAULT_NUM_SMS,
               fuse_ops: bool = True) -> list[Plan]:
    """The Plan of every rank, in rank order. The ranks' graphs have the same ops and shapes
    (only the weights bound to them differ), so the plans are identical today; they are kept
    per rank so that a rank-specific schedule (or peer addresses in the records) can follow."""
    plans = []
    for tp in TensorParallel.all(size):
        graph = build_graph(cfg, shape, num_sms=num_sms, tp=tp)
        plan = compile_graph(graph, num_sms, fuse_ops=fuse_ops)
        plan.meta["tensor_parallel"] = {"rank": tp.rank, "size": tp.size}
        plans.append(plan)
    return plans
