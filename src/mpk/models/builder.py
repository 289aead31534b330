"""Model builder: ModelConfig -> Graph of one decode step (Qwen3 and Llama 3 share it).

The graph is written op by op (rmsnorm, linear, attention ...); the compiler fuses each rmsnorm
into the prologue of the linears that read it. Epilogues are part of the linear op: gate_up
ends in silu*mul, lm_head in a per-task argmax, o_proj and down add the residual; attention
prepares q and k (norms, RoPE) and appends to the KV cache itself. So a layer runs in five
dependent phases: qkv, attention, o_proj, gate_up, down. Each linear is cut into one task per
SM (contiguous row ranges, linear/geometry.py). A mixture-of-experts layer's MLP
(cfg.is_moe_layer) is models/moe.py's router, experts' gate_up and experts' down instead.

Weights use graph names; `graph_weights` turns Hugging Face tensors into them (fused QKV grouped
per KV head, stacked gate/up, the RoPE table).

A plan rounds every row as a plan of DecodeShape.numerics_rows rows (its batch unless told
otherwise): attention's KV split count and each linear's tasks and input chunk (attr xc) are
chosen for that batch, since they set the order of a row's sums; the grids' row axes stay the
plan's own (tests/engine/test_lone_plan_numerics.py lists what sets the order, kind by kind).

With `tp` (mpk.parallel.TensorParallel) both build ONE RANK's share of a tensor-parallel model:
its KV heads and MLP columns, and o_proj / down_proj writing an f32 partial that an `allreduce`
op sums over the ranks (adding the residual once). tp=None builds exactly the single-GPU graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mpk.dtypes import DType
from mpk.errors import UnsupportedError
from mpk.graph.graph import DEFAULT_NUM_SMS, Graph
from mpk.models import decode_io as io
from mpk.models.config import ModelConfig
from mpk.models.moe import check_no_tp, moe_block, moe_weights
from mpk.models.rope import rope_table
from mpk.tasks.attention.task import MAX_SPLITS, effective_splits
from mpk.tasks.linear.task import MAX_BATCH, chunk_k, min_tasks
from mpk.tensors import Role

if TYPE_CHECKING:  # models/ stays below parallel/: the builder only calls tp's methods
    from mpk.parallel.tp import TensorParallel

BF16, F32, I32 = DType.BF16, DType.F32, DType.I32
# Attention's split_positions (tasks/attention effective_splits): a row's context stays in one KV
# split up to 128 positions (one round of the kernel's 8 warps of 16-position blocks) and takes
# ceil(positions / 64) beyond (3 or more). qwen3-0.6b b1 on an H100 (perf-log, fortieth session):
# at 128 positions 2 / 4 / 8 splits cost 10% (one round either way, plus the merge); splits of 64
# beat those of 128 by 3.5-3.8% at 200-300 and 576 positions and by 0.5% at 1,400 (the fewer KV
# bytes a SM stages, the sooner its round ends).
SPLIT_POSITIONS = 64
# Attention's query heads are parted over tasks (tasks/attention) for groups of PART_GROUP or
# more, down to PART_HEADS heads a task, while the parted op takes at most PART_SMS of the SMs:
# qwen3-30b-a3b (G = 8) at b1 (4 -> 16 tasks) 1.2% faster, at b8 (32 -> 128) 0.1%, at b16
# (64 -> 128) 0.9% slower; at G = 4 the 8B models and llama-3.2-1b moved +-0.2% at b1 (perf-log,
# twenty-fourth session).
PART_GROUP = 8
PART_HEADS = 2
PART_SMS = 1 / 4


@dataclass(frozen=True)
class DecodeShape:
    """Sizes fixed at compile time: rows per step, steps per launch, the paged KV cache."""

    batch: int = 1
    steps_per_launch: int = 16
    page_size: int = 16
    max_pages: int = 64  # per sequence: max sequence length = max_pages * page_size
    num_pages: int = 64  # per layer, shared by all rows
    # The batch whose plan this one rounds as (None: batch): the choices that set the order of a
    # row's sums (attention's KV splits, each linear's tasks and input chunks) are made for it.
    # The serving engine's one-row plan takes its max_batch, so a lone request's tokens equal
    # what the max_batch plan beside it would give. At least batch: a plan's input chunks are
    # sized for its numerics batch's staged rows, which must hold its own.
    numerics_batch: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.batch <= MAX_BATCH:
            raise UnsupportedError(f"batch {self.batch}: MPK decodes 1 to {MAX_BATCH} rows per "
                                   f"step")
        if min(self.steps_per_launch, self.page_size, self.max_pages, self.num_pages) <= 0:
            raise UnsupportedError(f"invalid decode shape {self}")
        if not self.batch <= self.numerics_rows <= MAX_BATCH:
            raise UnsupportedError(f"numerics_batch {self.numerics_batch}: a plan of "
                                   f"{self.batch} rows rounds as a plan of {self.batch} to "
                                   f"{MAX_BATCH} rows")

    @property
    def max_seq_len(self) -> int:
        return self.max_pages * self.page_size

    @property
    def numerics_rows(self) -> int:
        """The batch the order-setting choices are made for (numerics_batch, or batch)."""
        return self.batch if self.numerics_batch is None else self.numerics_batch


def choose_split(rows: int, target_tasks: int, multiple: int = 8) -> int:
    """How many EQUAL tiles to cut `rows` into: tiles of a multiple of `multiple` rows, the tile
    count filling `target_tasks` slots as evenly as possible (ties: fewer, larger tiles). For
    kinds that need equal tiles (the embedding, the tensor-parallel all-reduce)."""
    target_tasks = max(1, target_tasks)
    best, best_score = 1, -1.0
    for d in range(1, rows + 1):
        if rows % d or (rows // d) % multiple and d != 1:
            continue
        waves = -(-d // target_tasks)
        score = d / (waves * target_tasks) - 0.02 * (waves - 1)
        if score > best_score + 1e-9:
            best, best_score = d, score
    return best


def spread(outputs: int, num_sms: int, k: int, batch: int, align: int = 8) -> int:
    """Tasks for a linear over `outputs` rows of K = k: one per SM, and whole waves of num_sms
    more when a chunked input needs smaller tasks (linear.min_tasks, at `batch`: the plan's
    numerics batch, whose chunk chunk_k the linear takes as its attr xc); then the fewest tasks that
    keep the largest task's row groups (pieces of `align` rows), so the tasks are as even as that
    allows. The largest task sets the op's phase, and a task one row group short of it is not
    faster: qwen3-0.6b's qkv (512 row groups) as 132 tasks gave 16 of them 3 row groups, walked
    as two blocks (2 + 1) with a shared reduction between, ~2.1 us against ~1.45 for one block of
    4 (perf-log, thirteenth session); as 128 tasks every one has 4."""
    waves = -(-min_tasks(outputs, k, batch, align) // num_sms)
    groups = -(-outputs // align)
    largest = -(-groups // (num_sms * waves))
    return max(1, -(-groups // largest))


def build_graph(cfg: ModelConfig, shape: DecodeShape, num_sms: int = DEFAULT_NUM_SMS,
                layers: range | None = None, tp: TensorParallel | None = None) -> Graph:
    layers = range(cfg.num_layers) if layers is None else layers
    if tp is not None:
        tp.check(cfg)
        check_no_tp(cfg)
    g = Graph()
    b, nb, h, d = shape.batch, shape.numerics_rows, cfg.hidden_size, cfg.head_dim
    g.add_tensor(io.PROMPT, (shape.steps_per_launch, b), I32, Role.IO)
    g.add_tensor(io.POSITIONS, (b,), I32, Role.IO)
    g.add_tensor(io.PAGE_TABLE, (b, shape.max_pages), I32, Role.IO)
    g.add_tensor(io.TOKENS_OUT, (shape.steps_per_launch, b), I32, Role.IO)
    g.add_tensor(io.TOKENS, (b,), I32, Role.ACTIVATION)
    g.add_tensor(io.SAMPLING, (b, io.SAMPLING_WORDS), I32, Role.IO)
    g.add_tensor(io.RUNS, (b, io.RUN_WORDS), I32, Role.IO)
    g.add_tensor("embed", (cfg.vocab_size, h), BF16, Role.WEIGHT)
    g.add_tensor("rope", (shape.max_seq_len, d), F32, Role.WEIGHT)
    g.add_tensor("hidden", (b, h), BF16, Role.ACTIVATION)
    g.add_op("embedding", "embed", (choose_split(h, max(1, h // 256), 64),),
             {"tokens": io.TOKENS, "prompt": io.PROMPT, "table": "embed", "out": "hidden"})
    for layer in layers:
        _attention_block(g, cfg, shape, num_sms, layer, tp)
        if cfg.is_moe_layer(layer):
            moe_block(g, cfg, shape.batch, num_sms, layer,
                      spread(cfg.num_experts, num_sms, cfg.hidden_size, nb),
                      chunk_k(nb, cfg.hidden_size))
        else:
            _mlp_block(g, cfg, shape, num_sms, layer, tp)
    _lm_head(g, cfg, shape, num_sms)
    return g


def _lm_head(g: Graph, cfg: ModelConfig, shape: DecodeShape, num_sms: int) -> None:
    lm_head(g, cfg, shape.batch, num_sms, "hidden", io.POSITIONS, io.RUNS, shape.numerics_rows)


def lm_head(g: Graph, cfg: ModelConfig, batch: int, num_sms: int, hidden: str,
            positions: str, runs: str | None, numerics_batch: int | None = None) -> None:
    """Final norm of `hidden` [batch, H] (fused into lm_head's prologue by the compiler), lm_head
    with the argmax of each task's slice in its epilogue (or, for rows that sample, of logits / T
    + Gumbel noise at the row's position), and the reduction to one token per row into TOKENS /
    TOKENS_OUT (which, for rows with top-k / top-p, selects from the logits). lm_head's tasks
    and input chunk follow `numerics_batch` (default: batch; DecodeShape.numerics_batch)."""
    b, h = batch, cfg.hidden_size
    nb = batch if numerics_batch is None else numerics_batch
    g.add_tensor("final_norm", (h,), BF16, Role.WEIGHT)
    g.add_tensor("lm_head", (cfg.vocab_size, h), BF16, Role.WEIGHT)
    g.add_tensor("final_hidden", (b, h), BF16, Role.ACTIVATION)
    g.add_tensor("logits", (b, cfg.vocab_size), F32, Role.ACTIVATION)
    g.add_op("rmsnorm", "final_norm", (1,), {"x": hidden, "weight": "final_norm",
                                             "out": "final_hidden"}, eps=cfg.rms_eps)
    tiles = spread(cfg.vocab_size, num_sms, h, nb)
    g.add_tensor("argmax_val", (b, tiles), F32, Role.ACTIVATION)
    g.add_tensor("argmax_idx", (b, tiles), I32, Role.ACTIVATION)
    where = {"sampling": io.SAMPLING, "positions": positions, **({"runs": runs} if runs else {})}
    g.add_op("linear", "lm_head", (tiles,), {"x": "final_hidden", "weight": "lm_head",
                                             "out": "logits", "part_val": "argmax_val",
                                             "part_idx": "argmax_idx", **where},
             epilogue="argmax", xc=chunk_k(nb, h))
    g.add_op("argmax_reduce", "sample", (b,), {"part_val": "argmax_val", "part_idx": "argmax_idx",
                                               "tokens": io.TOKENS, "tokens_out": io.TOKENS_OUT,
                                               "logits": "logits", **where})


def _attention_block(g: Graph, cfg: ModelConfig, shape: DecodeShape, num_sms: int,
                     layer: int, tp: TensorParallel | None = None) -> None:
    p = f"layers.{layer}."
    b, nb, h, d = shape.batch, shape.numerics_rows, cfg.hidden_size, cfg.head_dim
    # This rank's KV heads (all of them without tp); their query heads come along (GQA groups).
    kvh = cfg.num_kv_heads if tp is None else tp.local_kv_heads(cfg)
    group = cfg.group
    width = kvh * (group + 2) * d
    g.add_tensor(p + "input_norm", (h,), BF16, Role.WEIGHT)
    g.add_tensor(p + "qkv_weight", (width, h), BF16, Role.WEIGHT)
    g.add_tensor(p + "o_weight", (h, kvh * group * d), BF16, Role.WEIGHT)
    cache = (shape.num_pages, shape.page_size, kvh, d)
    g.add_tensor(io.k_cache(layer), cache, BF16, Role.IO)
    g.add_tensor(io.v_cache(layer), cache, BF16, Role.IO)
    g.add_tensor(p + "x_norm", (b, h), BF16, Role.ACTIVATION)
    g.add_tensor(p + "qkv", (b, width), BF16, Role.ACTIVATION)
    g.add_tensor(p + "attn", (b, kvh * group * d), BF16, Role.ACTIVATION)
    g.add_op("rmsnorm", p + "input_norm", (1,), {"x": "hidden", "weight": p + "input_norm",
                                                 "out": p + "x_norm"}, eps=cfg.rms_eps)
    g.add_op("linear", p + "qkv", (spread(width, num_sms, h, nb),),
             {"x": p + "x_norm", "weight": p + "qkv_weight", "out": p + "qkv"},
             xc=chunk_k(nb, h))
    _attention(g, cfg, shape, num_sms, p, layer, kvh)
    _row_linear(g, shape, cfg, tp, num_sms, p + "o_proj", p + "attn", p + "o_weight",
                p + "attn_partial", p + "attn_allreduce")


def _attention(g: Graph, cfg: ModelConfig, shape: DecodeShape, num_sms: int, p: str,
               layer: int, kvh: int) -> None:
    b, group, d = shape.batch, cfg.group, cfg.head_dim
    # As many KV splits as the longest context uses (SPLIT_POSITIONS), within one wave of the
    # SMs; a row uses fewer while its context is shorter. The count sets the order of a row's
    # softmax sums (a split's positions, then the merge's sum over the splits), so it is the
    # numerics batch's; the grid's rows stay this plan's.
    cap = max(1, min(MAX_SPLITS, num_sms // (kvh * shape.numerics_rows), shape.max_pages))
    splits = effective_splits(shape.max_seq_len, cap, SPLIT_POSITIONS)
    ops = {"qkv": p + "qkv", "rope": "rope", "positions": io.POSITIONS, "runs": io.RUNS,
           "page_table": io.PAGE_TABLE, "k_cache": io.k_cache(layer),
           "v_cache": io.v_cache(layer)}
    if cfg.qk_norm:
        g.add_tensor(p + "q_norm", (d,), BF16, Role.WEIGHT)
        g.add_tensor(p + "k_norm", (d,), BF16, Role.WEIGHT)
        ops.update(q_norm=p + "q_norm", k_norm=p + "k_norm")
    if splits == 1:
        g.add_op("attention", p + "attention", (kvh * _query_parts(group, kvh * b, num_sms), b, 1),
                 {**ops, "out": p + "attn"}, eps=cfg.rms_eps)
        return
    g.add_tensor(p + "part_o", (b, kvh, splits, group * d), F32, Role.ACTIVATION)
    g.add_tensor(p + "part_lse", (b, kvh, splits, group), F32, Role.ACTIVATION)
    g.add_op("attention", p + "attention", (kvh, b, splits),
             {**ops, "part_o": p + "part_o", "part_lse": p + "part_lse", "out": p + "attn"},
             eps=cfg.rms_eps, split_positions=SPLIT_POSITIONS)


def _query_parts(group: int, tasks: int, num_sms: int) -> int:
    """Query-head parts per KV head (tasks/attention: a part prepares and merges only its heads;
    the values do not change): for groups of PART_GROUP or more, down to PART_HEADS heads a
    task while the tasks take at most PART_SMS of the SMs. The prepare's vectors (GP + 2 a
    task, 8 warps) and the merge grow with the heads a task holds; the KV loop does not."""
    parts = 1
    while group >= PART_GROUP and group % (parts * 2) == 0 and \
            group // (parts * 2) >= PART_HEADS and tasks * parts * 2 <= PART_SMS * num_sms:
        parts *= 2
    return parts


def _mlp_block(g: Graph, cfg: ModelConfig, shape: DecodeShape, num_sms: int, layer: int,
               tp: TensorParallel | None = None) -> None:
    p = f"layers.{layer}."
    b, nb, h = shape.batch, shape.numerics_rows, cfg.hidden_size
    inter = cfg.intermediate_size if tp is None else tp.local_intermediate(cfg)
    g.add_tensor(p + "post_norm", (h,), BF16, Role.WEIGHT)
    g.add_tensor(p + "gate_up_weight", (2, inter, h), BF16, Role.WEIGHT)
    g.add_tensor(p + "down_weight", (h, inter), BF16, Role.WEIGHT)
    g.add_tensor(p + "mlp_norm", (b, h), BF16, Role.ACTIVATION)
    g.add_tensor(p + "act", (b, inter), BF16, Role.ACTIVATION)
    g.add_op("rmsnorm", p + "post_norm", (1,), {"x": "hidden", "weight": p + "post_norm",
                                                "out": p + "mlp_norm"}, eps=cfg.rms_eps)
    g.add_op("linear", p + "gate_up", (spread(inter, num_sms, h, nb, 4),),
             {"x": p + "mlp_norm", "weight": p + "gate_up_weight", "out": p + "act"},
             epilogue="silu_mul", xc=chunk_k(nb, h))
    _row_linear(g, shape, cfg, tp, num_sms, p + "down", p + "act", p + "down_weight",
                p + "mlp_partial", p + "mlp_allreduce")


def _row_linear(g: Graph, shape: DecodeShape, cfg: ModelConfig, tp: TensorParallel | None,
                num_sms: int, name: str, x: str, weight: str, partial: str, reduce: str) -> None:
    """hidden += x @ weight^T: in place on one GPU; with tp, this rank's K slice writes an f32
    partial and `allreduce` adds the sum of all ranks' partials (and the residual, once)."""
    h, nb, k = cfg.hidden_size, shape.numerics_rows, g.tensors[x].shape[-1]
    if tp is None:
        g.add_op("linear", name, (spread(h, num_sms, k, nb),),
                 {"x": x, "weight": weight, "residual": "hidden", "out": "hidden"},
                 xc=chunk_k(nb, k))
        return
    # f32, unrounded: the ranks' partials must sum to the full fp32 product, which allreduce then
    # rounds once, as the single-rank linear does (bf16 partials would round G times).
    # Equal tiles, the same for the linear and the all-reduce: allreduce tile i waits on producer
    # tile i of every rank.
    tiles = choose_split(h, num_sms)
    g.add_tensor(partial, (shape.batch, h), F32, Role.ACTIVATION)
    g.add_op("linear", name, (tiles,), {"x": x, "weight": weight, "out": partial},
             xc=chunk_k(nb, k))
    g.add_op("allreduce", reduce, (tiles,), {"partial": partial, "residual": "hidden",
                                             "out": "hidden"}, ranks=tp.size)


def graph_weights(cfg: ModelConfig, hf: dict[str, torch.Tensor], max_pos: int,
                  layers: range | None = None,
                  tp: TensorParallel | None = None) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> the graph's weight tensors (done once at load); with `tp`, the
    share of rank tp.rank (column / row slices, replicated norms, embedding and lm_head)."""
    layers = range(cfg.num_layers) if layers is None else layers
    kvh, group, d, h = cfg.num_kv_heads, cfg.group, cfg.head_dim, cfg.hidden_size
    embed = hf["model.embed_tokens.weight"]
    out = {"embed": embed, "final_norm": hf["model.norm.weight"],
           "lm_head": embed if cfg.tie_embeddings else hf["lm_head.weight"],
           "rope": rope_table(cfg, max_pos).to(embed.device)}
    for layer in layers:
        src, dst = f"model.layers.{layer}.", f"layers.{layer}."
        q = hf[src + "self_attn.q_proj.weight"].reshape(kvh, group, d, h)
        k = hf[src + "self_attn.k_proj.weight"].reshape(kvh, 1, d, h)
        v = hf[src + "self_attn.v_proj.weight"].reshape(kvh, 1, d, h)
        out[dst + "qkv_weight"] = torch.cat([q, k, v], dim=1).reshape(kvh * (group + 2) * d, h)
        out[dst + "o_weight"] = hf[src + "self_attn.o_proj.weight"]
        out[dst + "input_norm"] = hf[src + "input_layernorm.weight"]
        out[dst + "post_norm"] = hf[src + "post_attention_layernorm.weight"]
        if cfg.is_moe_layer(layer):
            out.update(moe_weights(cfg, hf, layer))
        else:
            out[dst + "gate_up_weight"] = torch.stack([hf[src + "mlp.gate_proj.weight"],
                                                       hf[src + "mlp.up_proj.weight"]])
            out[dst + "down_weight"] = hf[src + "mlp.down_proj.weight"]
        if cfg.qk_norm:
            out[dst + "q_norm"] = hf[src + "self_attn.q_norm.weight"]
            out[dst + "k_norm"] = hf[src + "self_attn.k_norm.weight"]
    if tp is not None:
        tp.check(cfg)
        check_no_tp(cfg)
        return tp.shard_weights(out)
    return {name: t.contiguous() for name, t in out.items()}
