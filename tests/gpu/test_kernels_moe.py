"""The MoE kinds' sm_90a kernels (moe_router, moe_gate_up, moe_down) against the CPU interpreter
(kernel_helpers.py says how a case runs), one-op graphs and whole MoE layers, then the whole
tiny-qwen3-moe model.

Expert ids must match exactly. A kernel's fp32 dot products add in another order than torch's,
which can move a router logit's bf16 rounding by one ulp and so flip a near-tie of two experts;
the router cases therefore use inputs on which every sum is exact in any order (grid_inputs), so
the bf16 logits, their ties and the chosen ids are fixed, whatever the order. Float outputs use
the helpers' bf16 tolerance, ||gpu - cpu|| / ||cpu|| <= 1e-2: each stored value is rounded to
bf16 (relative step 2^-8 = 3.9e-3) after fp32 sums that differ from torch's in the last bits, so
an element differs by at most an ulp or two where a rounding flips (silu_mul rounds three times,
moe_down twice per slot and once more with the residual), and only a few percent of elements
flip: the norm-wise error stays well under 1e-2, while a wrong expert, slot, row or weight
gives errors of order 1.
"""

from __future__ import annotations

import pytest
import torch

from mpk.graph.graph import Graph
from mpk.models import moe
from mpk.tasks.numerics import rmsnorm_rows
from tests.gpu.kernel_helpers import BF16, I32, Role, assert_close, gen, run_both

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]

EPS = 1e-6
H30, I30, E30, K30 = 2048, 768, 128, 8  # qwen3-30b-a3b: hidden, moe_intermediate, experts, top-k


# ---- inputs ------------------------------------------------------------------------------------
def grid_inputs(b: int, h: int, e: int, g: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router inputs (x, norm weight, gate) on which every fp32 sum is exact in any order:
    x in {+-c, +-2c} (squares are multiples of c^2: the sum of squares, hence 1/rms, is the
    same in any order), norm weights in {1/2, 1, 2}, so x_norm = +-a * 2^k for one bf16 a per
    row, and gate entries n / 256 with |n| <= 8: every product is a multiple of a * 2^-9 and
    every partial sum an integer number of those units, below 2^24 of them (checked)."""
    sign = torch.randint(0, 2, (b, h), generator=g) * 2 - 1
    x = (sign * torch.randint(1, 3, (b, h), generator=g) * 0.75).bfloat16()
    w = (2.0 ** torch.randint(-1, 2, (h,), generator=g).float()).bfloat16()
    gate = (torch.randint(-8, 9, (e, h), generator=g) / 256).bfloat16()
    units = (w.float().abs() * 4 * (gate.float().abs() * 256)).sum(dim=1)  # per expert
    assert float(units.max()) * 256 < 2**24, "partial sums could round: make h smaller"
    return x, w, gate


def plant_ties(x: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, k: int) -> torch.Tensor:
    """The gate with equal rows where the routing decides: row 0's best expert copied over its
    second best (a tie at the top), row 1's k-th best copied over its (k+1)-th (a tie across
    the top-k boundary). Ties must go to the lower expert id on both sides."""
    logits = rmsnorm_rows(x, w, EPS).double() @ gate.double().T  # exact (see grid_inputs)
    order = logits.argsort(dim=1, descending=True)
    gate = gate.clone()
    if gate.shape[0] > 1:
        gate[order[0, 1]] = gate[order[0, 0]]
    if x.shape[0] > 1 and k < gate.shape[0]:
        gate[order[1, k]] = gate[order[1, k - 1]]
    return gate


def distinct_ids(b: int, e: int, k: int, g: torch.Generator, same: bool = False) -> torch.Tensor:
    """[b, k] int32 ids, distinct within a row (as the router writes them); `same`: every row
    the same experts, so each expert is chosen by all b rows."""
    rows = [torch.randperm(e, generator=g)[:k] for _ in range(1 if same else b)]
    return torch.stack(rows * b if same else rows).to(torch.int32)


# ---- graphs ------------------------------------------------------------------------------------
def add_router(graph: Graph, p: str, b: int, h: int, e: int, k: int, renorm: bool) -> None:
    graph.add_tensor(p + "x", (b, h), BF16, Role.IO)
    graph.add_tensor(p + "norm", (h,), BF16, Role.WEIGHT)
    graph.add_tensor(p + "gate", (e, h), BF16, Role.WEIGHT)
    graph.add_tensor(p + "xn", (b, h), BF16, Role.ACTIVATION)
    graph.add_tensor(p + "ids", (b, k), I32, Role.ACTIVATION)
    graph.add_tensor(p + "wts", (b, k), BF16, Role.ACTIVATION)
    moe.add_router(graph, p, p + "x", p + "norm", p + "gate", p + "xn", p + "ids", p + "wts",
                   eps=EPS, renormalize=renorm, gate_tasks=min(16, -(-e // 8)))


def add_gate_up(graph: Graph, p: str, b: int, e: int, k: int, inter: int, tiles: int,
                x: str, ids: str) -> None:
    h = graph.tensors[x].shape[1]
    graph.add_tensor(p + "w13", (e, 2, inter, h), BF16, Role.WEIGHT)
    graph.add_tensor(p + "act", (b, k, inter), BF16, Role.ACTIVATION)
    graph.add_op("moe_gate_up", p + "gate_up", (min(e, b * k), tiles),
                 {"x": x, "expert_ids": ids, "weight": p + "w13", "out": p + "act"})


def add_down(graph: Graph, p: str, e: int, h: int, tasks: int, x: str, ids: str, wts: str,
             residual: str, out: str) -> None:
    inter = graph.tensors[x].shape[2]
    graph.add_tensor(p + "w2", (e, h, inter), BF16, Role.WEIGHT)
    graph.add_op("moe_down", p + "down", (tasks,),
                 {"x": x, "expert_ids": ids, "expert_weights": wts, "weight": p + "w2",
                  "residual": residual, "out": out})


def expert_weights(e: int, h: int, inter: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"w13": (torch.randn(e, 2, inter, h, generator=g) / h**0.5).bfloat16(),
            "w2": (torch.randn(e, h, inter, generator=g) / inter**0.5).bfloat16()}


# ---- moe_router --------------------------------------------------------------------------------
@pytest.mark.parametrize("b,h,e,k,renorm", [
    (1, H30, E30, K30, True),     # qwen3-30b-a3b, batch 1
    (8, H30, E30, K30, True),
    (16, H30, E30, K30, False),   # without renormalisation (norm_topk_prob off)
    (3, 256, 6, 2, True),         # tiny-qwen3-moe-like
    (16, 256, 10, 3, False),      # many rows on few experts
    (5, 128, 8, 8, True),         # every expert chosen (K = E)
    (4, 512, 512, 8, True),       # the kernels' most experts
    (2, 64, 1, 1, False),         # one expert: weight 1 when renormalised, its probability 1
])
def test_router(b: int, h: int, e: int, k: int, renorm: bool) -> None:
    g = gen(b * 1000 + e * 10 + k)
    x, w, gate = grid_inputs(b, h, e, g)
    gate = plant_ties(x, w, gate, k)
    graph = Graph()
    add_router(graph, "", b, h, e, k, renorm)
    cpu, gpu = run_both(graph, {"x": x, "norm": w, "gate": gate}, ["xn", "ids", "wts"])
    assert_close(cpu["ids"], gpu["ids"], "expert_ids")
    assert_close(cpu["xn"], gpu["xn"], "x_norm")
    assert_close(cpu["wts"], gpu["wts"], "expert_weights")


def test_router_equal_logits_everywhere() -> None:
    """A zero gate: every logit is 0, every probability 1/E, so the ids are 0..K-1 in order."""
    b, h, e, k = 3, 256, 16, 4
    x, w, _ = grid_inputs(b, h, e, gen(7))
    graph = Graph()
    add_router(graph, "", b, h, e, k, True)
    gate = torch.zeros(e, h, dtype=torch.bfloat16)
    cpu, gpu = run_both(graph, {"x": x, "norm": w, "gate": gate}, ["ids", "wts"])
    assert gpu["ids"].tolist() == [list(range(k))] * b
    assert_close(cpu["ids"], gpu["ids"], "expert_ids")
    assert_close(cpu["wts"], gpu["wts"], "expert_weights", exact=True)


# ---- moe_gate_up -------------------------------------------------------------------------------
@pytest.mark.parametrize("b,h,inter,e,k,tiles,same", [
    (1, H30, I30, E30, K30, 16, False),   # qwen3-30b-a3b at batch 1: 8 slots x 16 ranges
    (8, H30, I30, E30, K30, 2, False),
    (16, H30, I30, E30, K30, 1, False),
    (16, 256, 40, E30, K30, 1, True),     # 16 rows on the same 8 experts: 2 groups of pairs
    (16, 256, 40, 6, 2, 3, False),        # repeated experts across rows, idle slots
    (3, 64, 24, 10, 3, 2, False),         # uneven ranges of the expert width
    (2, 1280, 40, 12, 4, 3, False),       # two rounds of a lane's vectors, 2nd partial
])
def test_gate_up(b, h, inter, e, k, tiles, same) -> None:
    g = gen(b * 100 + e + tiles)
    graph = Graph()
    graph.add_tensor("x", (b, h), BF16, Role.IO)
    graph.add_tensor("ids", (b, k), I32, Role.IO)
    add_gate_up(graph, "", b, e, k, inter, tiles, "x", "ids")
    inputs = {"x": torch.randn(b, h, generator=g).bfloat16(),
              "ids": distinct_ids(b, e, k, g, same),
              "w13": expert_weights(e, h, inter, g)["w13"]}
    cpu, gpu = run_both(graph, inputs, ["act"])
    assert_close(cpu["act"], gpu["act"], "expert_act")


def test_gate_up_row_naming_an_expert_twice() -> None:
    """Batch 1, where the out is flagged, with an id repeated (only tests write such rows:
    moe_router's top-k never repeats an expert): the slot of the repeated expert computes both
    of its pairs and stores both ranges' words, the unused slot none."""
    g = gen(7)
    graph = Graph()
    graph.add_tensor("x", (1, 256), BF16, Role.IO)
    graph.add_tensor("ids", (1, 3), I32, Role.IO)
    add_gate_up(graph, "", 1, 10, 3, 40, 3, "x", "ids")
    inputs = {"x": torch.randn(1, 256, generator=g).bfloat16(),
              "ids": torch.tensor([[4, 7, 4]], dtype=torch.int32),
              "w13": expert_weights(10, 256, 40, g)["w13"]}
    cpu, gpu = run_both(graph, inputs, ["act"])
    assert_close(cpu["act"], gpu["act"], "expert_act")


# ---- moe_down ----------------------------------------------------------------------------------
@pytest.mark.parametrize("b,h,inter,e,k,tasks,same,in_place", [
    (1, H30, I30, E30, K30, 132, False, True),   # qwen3-30b-a3b: one task per SM, in place
    (8, H30, I30, E30, K30, 132, False, False),
    (16, H30, I30, E30, K30, 64, True, True),    # every row on the same experts
    (16, 256, 40, 6, 2, 5, False, False),
    (3, 64, 24, 10, 3, 3, False, True),          # K = 3: a partial group of slots
    (2, 320, 1280, 12, 4, 7, False, False),      # two rounds of a lane's vectors, 2nd partial
])
def test_down(b, h, inter, e, k, tasks, same, in_place) -> None:
    g = gen(b * 100 + e + tasks)
    graph = Graph()
    graph.add_tensor("act", (b, k, inter), BF16, Role.IO)
    graph.add_tensor("ids", (b, k), I32, Role.IO)
    graph.add_tensor("wts", (b, k), BF16, Role.IO)
    graph.add_tensor("hidden", (b, h), BF16, Role.IO)
    out = "hidden" if in_place else "out"
    if not in_place:
        graph.add_tensor("out", (b, h), BF16, Role.ACTIVATION)
    add_down(graph, "", e, h, tasks, "act", "ids", "wts", "hidden", out)
    inputs = {"act": torch.randn(b, k, inter, generator=g).bfloat16(),
              "ids": distinct_ids(b, e, k, g, same),
              "wts": torch.softmax(torch.randn(b, k, generator=g), dim=1).bfloat16(),
              "hidden": torch.randn(b, h, generator=g).bfloat16(),
              "w2": expert_weights(e, h, inter, g)["w2"]}
    cpu, gpu = run_both(graph, inputs, [out])
    assert_close(cpu[out], gpu[out], out)


# ---- whole MoE layers --------------------------------------------------------------------------
@pytest.mark.parametrize("b,renorm", [(1, True), (16, True), (8, False)])
def test_two_moe_layers(b: int, renorm: bool) -> None:
    """Two qwen3-30b-a3b MoE layers (router -> gate_up -> down, in place on the layer's hidden,
    as models/moe.py builds them) in one launch: the dependencies, the scratch sizes and the
    ops' tasks interleaved over the SMs. Each layer's hidden is its own grid input, so its
    routing is exact (a layer fed the other's output would route on rounded values)."""
    g = gen(30 + b)
    graph, inputs, names = Graph(), {}, []
    for layer in range(2):
        p = f"l{layer}."
        add_router(graph, p, b, H30, E30, K30, renorm)
        add_gate_up(graph, p, b, E30, K30, I30, max(1, 132 // min(E30, b * K30)), p + "xn",
                    p + "ids")
        add_down(graph, p, E30, H30, 132, p + "act", p + "ids", p + "wts", p + "x", p + "x")
        x, w, gate = grid_inputs(b, H30, E30, g)
        inputs |= {p + "x": x, p + "norm": w, p + "gate": gate}
        inputs |= {p + name: t for name, t in expert_weights(E30, H30, I30, g).items()}
        names += [p + n for n in ("ids", "xn", "wts", "act", "x")]
    cpu, gpu = run_both(graph, inputs, names, num_sms=132)
    for name in names:
        assert_close(cpu[name], gpu[name], name)


# ---- the whole tiny-qwen3-moe model ------------------------------------------------------------
def test_tiny_qwen3_moe_every_buffer() -> None:
    """tiny-qwen3-moe (6 experts top-2, layer 1 dense), batch 2, 3 decode steps in one launch on
    both backends from the same weights, KV noise and prompt: every buffer (ids exactly, tokens
    up to near-ties of the logits, as mpk check compares them)."""
    from mpk.backends.registry import create_executor
    from mpk.check import _compare_any, _outputs
    from mpk.engine.bind import bind_model
    from mpk.models.builder import DecodeShape
    from mpk.models.config import get_preset
    from mpk.models.weights import random_weights
    from tests.interp.model_run import make_plan

    cfg, seed, steps = get_preset("tiny-qwen3-moe"), 20261201, 3
    shape = DecodeShape(batch=2, steps_per_launch=steps, page_size=4, max_pages=4, num_pages=8)
    plan = make_plan(cfg, shape, num_sms=132)
    assert {"moe_router", "moe_gate_up", "moe_down"} <= set(plan.kinds)
    weights = random_weights(cfg, seed=seed)
    prompt = torch.randint(cfg.vocab_size, (steps, shape.batch), dtype=torch.int32,
                           generator=gen(seed))
    got = {}
    for backend in ("cpu", "cuda"):
        ex = create_executor(plan, backend, poison=True)
        bind_model(ex, plan, cfg, shape, weights, seed)
        ex.write("prompt", prompt)
        ex.write("positions", torch.zeros(shape.batch, dtype=torch.int32))
        ex.run(steps)
        got[backend] = _outputs(ex, plan)
        del ex
    cpu, gpu = got["cpu"], got["cuda"]
    rows = [_compare_any(name, name, gpu[name], cpu[name], cpu.get("logits")) for name in cpu]
    bad = [r for r in rows if not r.passed]
    assert not bad, "\n".join(f"{r.tensor}: {r.rel_err:.3g} > {r.tolerance}" for r in bad)
    assert sum("expert_ids" in r.tensor for r in rows) == 2  # the two MoE layers' ids
