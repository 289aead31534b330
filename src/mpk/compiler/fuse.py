"""Fusion rewrites on the Graph, so models stay op by op and readable.

rmsnorm -> linear: when the normalised tensor is an activation read only by linears (as x, with
no prologue) and nothing rewrites the norm's input in between, each linear takes the norm's input
with the rmsnorm prologue and the norm op disappears. This removes one dependency phase per
norm. (silu*mul is the gate_up linear's epilogue and RoPE is part of attention: ops of their
own, not fusions.)
"""

from __future__ import annotations

from mpk.graph.graph import Graph, Op
from mpk.tensors import Role

_PROLOGUE = {"rmsnorm": "rmsnorm"}


def fuse(graph: Graph) -> Graph:
    ops = list(graph.ops)
    replaced: dict[int, Op] = {}
    dropped: set[int] = set()
    for i, op in enumerate(ops):
        if op.kind not in _PROLOGUE:
            continue
        out = op.tensor_of("out")
        if graph.tensors[out].role is not Role.ACTIVATION:
            continue
        users = [j for j, o in enumerate(ops) if j != i and out in dict(o.operands).values()]
        if not users or not all(_fusable_user(ops[j], out) for j in users):
            continue
        src = op.tensor_of("x")
        if any(src in _written(ops[k]) for k in range(i + 1, max(users) + 1)):
            continue  # the input changes before (or, in place, by) a user: keep the norm
        for j in users:
            replaced[j] = _with_prologue(replaced.get(j, ops[j]), op)
        dropped.add(i)
    if not dropped:
        return graph
    fused = Graph()
    fused.tensors = dict(graph.tensors)
    for i, op in enumerate(ops):
        if i in dropped:
            continue
        op = replaced.get(i, op)
        attrs = dict(op.attrs)
        fused.add_op(op.kind, op.name, op.grid, dict(op.operands), dict(op.splits), **attrs)
    return fused


def _fusable_user(op: Op, tensor: str) -> bool:
    operands = dict(op.operands)
    uses = [k for k, v in operands.items() if v == tensor]
    return op.kind == "linear" and uses == ["x"] and dict(op.attrs)["prologue"] == "none"


def _written(op: Op) -> set[str]:
    from mpk.tasks.registry import get_kind

    kind = get_kind(op.kind)
    return {t for name, t in op.operands if kind.operand(name).access.writes}


def _with_prologue(user: Op, producer: Op) -> Op:
    operands = dict(user.operands)
    operands["x"] = producer.tensor_of("x")
    splits = dict(user.splits)
    splits["x"] = (None, None, None)
    attrs = dict(user.attrs)
    attrs["prologue"] = _PROLOGUE[producer.kind]
    if producer.kind == "rmsnorm":
        operands["norm_weight"] = producer.tensor_of("weight")
        splits["norm_weight"] = (None, None, None)
        attrs["eps"] = dict(producer.attrs)["eps"]
    return Op(user.name, user.kind, user.grid, tuple(operands.items()), tuple(splits.items()),
              tuple(sorted(attrs.items())))
