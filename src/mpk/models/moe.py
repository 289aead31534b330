"""The mixture-of-experts block of a decode step (Qwen3-MoE), for builder.py.

A MoE layer's MLP instead of the dense rmsnorm + gate_up + down (add_router, then two ops):
  rmsnorm      the post-attention RMSNorm (x_norm, what the experts read), and beside it
  linear       the router gate with the same RMSNorm as its prologue: bf16 logits, spread over
               SMs like every linear (both read `hidden`, so they run in the same phase);
  moe_router   per batch row: softmax, top-k and the routing weights (expert_ids,
               expert_weights);
  moe_gate_up  a slot per distinct chosen expert x a range of the expert width: the chosen
               experts' gate/up projections and silu*mul for every (row, slot) that chose them;
  moe_down     a range of the hidden size per task: the chosen experts' down projections,
               weighted, summed and added to the residual, in place on `hidden`.
The dependencies follow from the operands: gate_up reads x_norm (rmsnorm) and expert_ids
(router), down reads the activations (gate_up) and the ids / weights (router) and writes
`hidden`, which the next layer's attention reads.

Weights: each layer's experts are stacked, [E, 2, I, H] (gate then up rows per expert) and
[E, H, I] (down), the layout weights.random_weights already allocates, so `moe_weights` reuses
those buffers instead of copying 61 GB of qwen3-30b-a3b experts a second time.
"""

from __future__ import annotations

import torch

from mpk.dtypes import DType
from mpk.errors import UnsupportedError
from mpk.graph.graph import Graph
from mpk.models.config import ModelConfig
from mpk.tasks.moe_down.task import ALIGN as DOWN_ALIGN
from mpk.tasks.moe_gate_up.task import ALIGN as GATE_UP_ALIGN
from mpk.tensors import Role

BF16, I32 = DType.BF16, DType.I32


def expert_slots(cfg: ModelConfig, batch: int) -> int:
    """moe_gate_up's axis 0: enough slots for every distinct expert a step can choose."""
    return min(cfg.num_experts, batch * cfg.num_experts_per_tok)


def add_router(g: Graph, p: str, x: str, norm_weight: str, gate: str, x_norm: str, ids: str,
               weights: str, *, eps: float, renormalize: bool, gate_tasks: int,
               gate_xc: int = 0) -> None:
    """The routing ops of one MoE layer (names prefixed by p): x_norm = RMSNorm(x), the bf16
    router logits by a linear of `gate_tasks` tasks (input chunk `gate_xc`, the linear's attr
    xc; 0: its own batch's) with the same RMSNorm as its prologue, and moe_router's top-k ids
    and weights. Tests build routers with this too."""
    b, e = g.tensors[x].shape[0], g.tensors[gate].shape[0]
    g.add_tensor(p + "router_logits", (b, e), BF16, Role.ACTIVATION)
    g.add_op("rmsnorm", p + "post_norm", (1,), {"x": x, "weight": norm_weight, "out": x_norm},
             eps=eps)
    g.add_op("linear", p + "router_gate", (gate_tasks,),
             {"x": x, "norm_weight": norm_weight, "weight": gate, "out": p + "router_logits"},
             prologue="rmsnorm", eps=eps, xc=gate_xc)
    g.add_op("moe_router", p + "router", (b,),
             {"logits": p + "router_logits", "expert_ids": ids, "expert_weights": weights},
             renormalize=renormalize)


def moe_block(g: Graph, cfg: ModelConfig, batch: int, num_sms: int, layer: int,
              gate_tasks: int, gate_xc: int) -> None:
    """Add layer `layer`'s MoE MLP to g: the router (add_router, its gate linear in
    `gate_tasks` tasks and input chunks of `gate_xc`), experts' gate/up, experts' down
    (+ residual). The experts' kinds compute a row alike at any batch and grid (a pair's dot
    products in one warp, the slots in order), so only the gate follows the numerics batch
    (builder.DecodeShape.numerics_batch)."""
    p = f"layers.{layer}."
    h, e, k, inter = (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                      cfg.moe_intermediate_size)
    g.add_tensor(p + "post_norm", (h,), BF16, Role.WEIGHT)
    g.add_tensor(p + "router_weight", (e, h), BF16, Role.WEIGHT)
    g.add_tensor(p + "experts_gate_up", (e, 2, inter, h), BF16, Role.WEIGHT)
    g.add_tensor(p + "experts_down", (e, h, inter), BF16, Role.WEIGHT)
    g.add_tensor(p + "mlp_norm", (batch, h), BF16, Role.ACTIVATION)
    g.add_tensor(p + "expert_ids", (batch, k), I32, Role.ACTIVATION)
    g.add_tensor(p + "expert_weights", (batch, k), BF16, Role.ACTIVATION)
    g.add_tensor(p + "expert_act", (batch, k, inter), BF16, Role.ACTIVATION)
    add_router(g, p, "hidden", p + "post_norm", p + "router_weight", p + "mlp_norm",
               p + "expert_ids", p + "expert_weights", eps=cfg.rms_eps,
               renormalize=cfg.norm_topk_prob, gate_tasks=gate_tasks, gate_xc=gate_xc)
    slots = expert_slots(cfg, batch)
    # About one task per SM: the slots times the ranges of the expert width fill the SMs (at
    # batch 1 of qwen3-30b-a3b: 8 slots x 16 ranges of 48 rows).
    tiles = max(1, min(max(1, num_sms // slots), -(-inter // GATE_UP_ALIGN)))
    g.add_op("moe_gate_up", p + "experts_gate_up", (slots, tiles),
             {"x": p + "mlp_norm", "expert_ids": p + "expert_ids",
              "weight": p + "experts_gate_up", "out": p + "expert_act"})
    g.add_op("moe_down", p + "experts_down", (max(1, min(num_sms, -(-h // DOWN_ALIGN))),),
             {"x": p + "expert_act", "expert_ids": p + "expert_ids",
              "expert_weights": p + "expert_weights", "weight": p + "experts_down",
              "residual": "hidden", "out": "hidden"})


def check_no_tp(cfg: ModelConfig) -> None:
    """Tensor parallelism does not split experts yet: a clear error instead of a wrong graph."""
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        raise UnsupportedError(f"model {cfg.name or cfg.arch!r} has mixture-of-experts layers; "
                               f"tensor parallelism does not support them yet (use tp=1)")


def moe_weights(cfg: ModelConfig, hf: dict[str, torch.Tensor],
                layer: int) -> dict[str, torch.Tensor]:
    """The graph's weights of MoE layer `layer` (without post_norm) from Hugging Face names."""
    src, dst = f"model.layers.{layer}.mlp.", f"layers.{layer}."
    n = cfg.num_experts
    gate = [hf[f"{src}experts.{e}.gate_proj.weight"] for e in range(n)]
    up = [hf[f"{src}experts.{e}.up_proj.weight"] for e in range(n)]
    down = [hf[f"{src}experts.{e}.down_proj.weight"] for e in range(n)]
    gate_up = _stacked_base(gate, up)
    down_all = _stacked_base(down)
    return {dst + "router_weight": hf[src + "gate.weight"],
            dst + "experts_gate_up": gate_up if gate_up is not None else
            torch.stack([torch.stack([g, u]) for g, u in zip(gate, up)]),
            dst + "experts_down": down_all if down_all is not None else torch.stack(down)}


def _stacked_base(*parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The buffer the tensors are views of when it is exactly their stack ([E, len(parts), ...]
    squeezed to [E, ...] for one part), as random_weights lays experts out; else None."""
    first = parts[0][0]
    base = first._base
    n = len(parts[0])
    shape = (n, *first.shape) if len(parts) == 1 else (n, len(parts), *first.shape)
    if base is None or tuple(base.shape) != shape or not base.is_contiguous() or \
            base.dtype != first.dtype:
        return None
    for e in range(n):
        for i, part in enumerate(parts):
            view = base[e] if len(parts) == 1 else base[e, i]
            if part[e].data_ptr() != view.data_ptr() or part[e].shape != view.shape:
                return None
    return base
