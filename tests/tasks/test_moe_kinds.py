"""The MoE kinds (moe_router -> moe_gate_up -> moe_down) through the CPU interpreter against a
plain torch MoE block written here from transformers' Qwen3MoeSparseMoeBlock semantics (bf16
stores where a bf16 model stores, fp32 softmax over all experts, top-k, optional
renormalisation, weighted bf16 products summed in fp32 and rounded once, plus the residual)."""

from __future__ import annotations

import pytest
import torch

from mpk.backends.registry import create_executor
from mpk.compiler.lower import compile_graph
from mpk.dtypes import DType
from mpk.errors import GraphError
from mpk.graph.graph import Graph
from mpk.models.moe import add_router
from mpk.tasks.moe_gate_up.task import checked_ids
from mpk.tasks.moe_router.task import route
from mpk.tensors import Role

EPS = 1e-6
BF16, I32 = DType.BF16, DType.I32


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _graph(b: int, h: int, e: int, k: int, inter: int, renorm: bool, tiles: int,
           down_tasks: int) -> Graph:
    g = Graph()
    g.add_tensor("hidden", (b, h), BF16, Role.IO)
    g.add_tensor("norm", (h,), BF16, Role.WEIGHT)
    g.add_tensor("gate", (e, h), BF16, Role.WEIGHT)
    g.add_tensor("w13", (e, 2, inter, h), BF16, Role.WEIGHT)
    g.add_tensor("w2", (e, h, inter), BF16, Role.WEIGHT)
    g.add_tensor("xn", (b, h), BF16, Role.ACTIVATION)
    g.add_tensor("ids", (b, k), I32, Role.ACTIVATION)
    g.add_tensor("wts", (b, k), BF16, Role.ACTIVATION)
    g.add_tensor("act", (b, k, inter), BF16, Role.ACTIVATION)
    add_router(g, "", "hidden", "norm", "gate", "xn", "ids", "wts", eps=EPS, renormalize=renorm,
               gate_tasks=-(-e // 8))
    g.add_op("moe_gate_up", "gate_up", (min(e, b * k), tiles),
             {"x": "xn", "expert_ids": "ids", "weight": "w13", "out": "act"})
    g.add_op("moe_down", "down", (down_tasks,),
             {"x": "act", "expert_ids": "ids", "expert_weights": "wts", "weight": "w2",
              "residual": "hidden", "out": "hidden"})
    return g


def _expected(x, norm, gate, w13, w2, k: int, renorm: bool):
    """(ids, weights, new hidden) of the torch MoE block."""
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    normed = _bf16(norm.float() * _bf16(xf * inv))
    # The gate linear's rmsnorm prologue: the norm weight folded into the gate (linear/task.py).
    probs = torch.softmax(_bf16((xf @ _bf16(gate.float() * norm.float()).T) * inv), dim=-1)
    top, ids = torch.topk(probs, k, dim=-1)  # random weights: no exact ties
    if renorm:
        top = top / top.sum(dim=-1, keepdim=True)
    top = _bf16(top)
    total = torch.zeros_like(xf)
    for row in range(x.shape[0]):
        for slot in range(k):
            ex = int(ids[row, slot])
            g = _bf16(normed[row] @ w13[ex, 0].float().T)
            u = _bf16(normed[row] @ w13[ex, 1].float().T)
            a = _bf16(_bf16(torch.nn.functional.silu(g)) * u)
            total[row] += _bf16(_bf16(a @ w2[ex].float().T) * top[row, slot])
    return ids, top, _bf16(xf + _bf16(total))


def _run(b, h, e, k, inter, renorm, tiles, down_tasks, seed, gate=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, generator=gen)
    x = (x.abs() if gate is not None else x).bfloat16()  # a given gate expects positive rows
    norm = (1 + 0.1 * torch.randn(h, generator=gen)).bfloat16()
    gate = (torch.randn(e, h, generator=gen) / h ** 0.5).bfloat16() if gate is None else gate
    w13 = (torch.randn(e, 2, inter, h, generator=gen) / h ** 0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, generator=gen) / inter ** 0.5).bfloat16()
    plan = compile_graph(_graph(b, h, e, k, inter, renorm, tiles, down_tasks), num_sms=4)
    ex = create_executor(plan, "cpu", order="random", seed=seed)
    for name, t in (("hidden", x.clone()), ("norm", norm), ("gate", gate), ("w13", w13),
                    ("w2", w2)):
        ex.bind(name, t)
    ex.run(1)
    got = (ex.read("ids").long(), ex.read("wts").float(), ex.read("hidden").float())
    return got, _expected(x, norm, gate, w13, w2, k, renorm)


@pytest.mark.parametrize("b,e,k,renorm,tiles,down_tasks", [
    (1, 6, 2, True, 2, 3),     # batch 1: K slots, one per chosen expert
    (3, 6, 2, False, 3, 5),    # rows sharing experts: idle slots, uneven ranges
    (4, 10, 3, True, 1, 1),    # one range each
    (2, 16, 8, False, 2, 4),   # top-8 (Qwen3-MoE's K)
])
def test_block_matches_torch(b: int, e: int, k: int, renorm: bool, tiles: int,
                             down_tasks: int) -> None:
    (ids, wts, out), (want_ids, want_wts, want_out) = _run(b, 64, e, k, 24, renorm, tiles,
                                                           down_tasks, seed=100 + b * e)
    assert torch.equal(ids, want_ids)
    assert torch.equal(wts, want_wts)
    # fp32 sums over different partitions may move a bf16 rounding by one ulp
    torch.testing.assert_close(out, want_out, rtol=2 ** -7, atol=1e-3)


def test_all_rows_on_two_experts_leave_idle_slots() -> None:
    """Every row picks experts 1 and 5 (a gate that only they match), so 6 of the 8 slots find
    no expert: the output must still be complete (activations start poisoned)."""
    e, h = 8, 64
    gate = torch.zeros(e, h)
    gate[1] = gate[5] = 1.0  # rows are positive: these two win by far
    gate[5, 0] = 0.5  # expert 1 first
    (ids, _, out), (want_ids, _, want_out) = _run(4, h, e, 2, 16, True, 2, 2, seed=3,
                                                  gate=gate.bfloat16())
    assert ids.tolist() == want_ids.tolist() == [[1, 5]] * 4
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, want_out, rtol=2 ** -7, atol=1e-3)


def test_route_ties_go_to_the_lower_id_and_renormalise_in_slot_order() -> None:
    logits = torch.tensor([[0.0, 2.0, 0.0, 0.0, 2.0, 0.0]])
    ids, w = route(logits, 3, renormalize=True)
    assert ids.tolist() == [[1, 4, 0]]
    probs = torch.softmax(logits[0], dim=0)[[1, 4, 0]]
    assert torch.equal(w[0], _bf16(probs / (probs[0] + probs[1] + probs[2])))
    _, plain = route(logits, 3, renormalize=False)
    assert torch.equal(plain[0], _bf16(probs))


def test_foreign_ids_and_bad_grids_are_refused() -> None:
    with pytest.raises(IndexError):
        checked_ids(torch.tensor([[0, 6]], dtype=torch.int32), 6)
    g = _graph(2, 64, 6, 2, 24, True, 1, 1)
    g.add_tensor("act2", (2, 2, 24), BF16, Role.ACTIVATION)
    with pytest.raises(GraphError, match="distinct expert"):
        g.add_op("moe_gate_up", "bad", (3, 1), {"x": "xn", "expert_ids": "ids",
                                                "weight": "w13", "out": "act2"})


def test_cuda_build_has_every_moe_kernel() -> None:
    """A MoE model's plan names no missing kernel (each kind has its sm90.cuh); the nvcc build
    itself is tests/cuda/test_nvcc_build.py's, the numerics tests/gpu/test_kernels_moe.py's."""
    from mpk.backends.cuda import codegen
    from mpk.models.builder import DecodeShape, build_graph
    from mpk.models.config import get_preset

    plan = compile_graph(build_graph(get_preset("tiny-qwen3-moe"), DecodeShape(batch=2)), 8)
    assert {"moe_router", "moe_gate_up", "moe_down"} <= set(plan.kinds)
    assert codegen.missing_kernels(plan.kinds) == []


@pytest.mark.parametrize("experts", [6, 32, 33, 128])
def test_router_registers_cover_every_expert(experts: int) -> None:
    """moe_router's kernel keeps a lane's experts l, l + 32, ... in ROUTER_EXPERTS_PER_LANE
    registers: the plan must ask for ceil(E / 32) of them, or experts past 32 x that would
    never be read (a silently wrong top-k on the GPU that no CPU test would see)."""
    plan = compile_graph(_graph(1, 64, experts, min(4, experts), 16, True, 1, 1), num_sms=4)
    assert dict(plan.constants)["ROUTER_EXPERTS_PER_LANE"] == -(-experts // 32)
