"""Flagged activations (compiler/flags.py): which tensors, which waits the CUDA controller skips,
and the epochs the op parameter rows carry."""

from __future__ import annotations

import numpy as np
import pytest

from mpk.compiler import flags, record
from mpk.compiler.deps import find_edges
from mpk.compiler.fuse import fuse
from mpk.compiler.lower import compile_graph
from mpk.compiler.tiling import tile_graph
from mpk.dtypes import DType
from mpk.graph.graph import Graph
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import get_preset
from mpk.parallel import rank_plans
from mpk.tasks.registry import get_kind
from mpk.tensors import Role

NUM_SMS = 16


def _plan(preset: str, batch: int = 1, max_pages: int = 64, num_sms: int = NUM_SMS):
    cfg = get_preset(preset)
    shape = DecodeShape(batch=batch, max_pages=max_pages)
    return cfg, compile_graph(build_graph(cfg, shape, num_sms=num_sms), num_sms)


def _records_by_op(plan):
    out: dict[str, list] = {}
    for sm in range(plan.num_sms):
        for i in range(int(plan.lengths[sm])):
            rec = plan.instrs[sm, i]
            out.setdefault(plan.ops[int(rec[record.OP])].name, []).append(rec)
    return out


def _entries(plan, op_name: str) -> dict[str, tuple[int, int]]:
    """operand -> (W, w) of the op's flag entries."""
    index = [o.name for o in plan.ops].index(op_name)
    op = plan.ops[index]
    names = [s.name for s in get_kind(op.kind).operands]
    out = {}
    for word in plan.op_params[index, record.FLAG_PARAMS:]:
        if (decoded := flags.decode_entry(int(word))) is not None:
            slot, writes, w = decoded
            out[names[slot]] = (writes, w)
    return out


def _signals(recs) -> set[int]:
    """The counters the records signal."""
    return {c for rec in recs for c in record.decode_signals(rec)}


def _polled_waits(rec, counters: set[int]) -> list[bool]:
    """For each same-step wait of `rec` on one of `counters`: is it polled (record.POLLED)?"""
    mask = int(rec[record.POLLED]) & ~record.POLLS
    return [bool(mask >> w & 1) for w, (c, _, prev) in enumerate(record.decode_waits(rec))
            if not prev and c in counters]


def test_dense_model_flags_the_residual_stream_and_the_layer_activations() -> None:
    # Long contexts: the KV range is split, and the last split writes attn (its S tasks' equal
    # out boxes count once: covers_whole).
    cfg, plan = _plan("tiny-qwen3")
    assert {op.grid[2] for op in plan.ops if op.kind == "attention"} == {8}
    flagged = {t.name for t in plan.tensors if t.flagged}
    layers = {f"layers.{i}.{n}" for i in range(cfg.num_layers) for n in ("act", "qkv", "attn")}
    assert flagged == {"hidden"} | layers
    _, plan = _plan("tiny-qwen3", max_pages=4)  # one split: attention writes attn itself
    assert "layers.0.attn" in {t.name for t in plan.tensors if t.flagged}
    for t in plan.tensors:  # twice the bytes on the device; the interpreter's shape unchanged
        if t.flagged:
            assert t.device_nbytes == 2 * 2 * t.shape[0] * t.shape[1]


@pytest.mark.parametrize("max_pages", [64, 4])
def test_consumers_of_flagged_tensors_skip_their_counter_waits(max_pages: int) -> None:
    cfg, plan = _plan("tiny-qwen3", max_pages=max_pages)  # 64: KV splits, the last one merges
    recs = _records_by_op(plan)
    for name, rows in recs.items():
        role = name.split(".")[-1]
        for rec in rows:
            waits = record.decode_waits(rec)
            word = int(rec[record.POLLED])
            mask = word & ~record.POLLS
            assert mask < (1 << len(waits)), name  # only existing waits
            # Every reader of hidden / act / qkv / attn polls it, so the storer watches it (the
            # embedding only writes hidden; the sampler reads plain tensors).
            polls = ("qkv", "attention", "o_proj", "gate_up", "down", "lm_head")
            assert bool(word & record.POLLS) == (role in polls), name
            same_step = [w for w, (_, _, prev) in enumerate(waits) if not prev]
            if role in polls:
                # Their same-step waits are on the producer of what they poll (attention: the
                # qkv tasks of its KV head, a piece counter).
                assert same_step and all(mask >> w & 1 for w in same_step), (name, waits, mask)
            else:
                assert mask == 0, (name, waits, mask)
            for w, (_, _, prev) in enumerate(waits):
                assert not (prev and mask >> w & 1), name  # previous-step waits always count


def test_epochs_follow_the_writes_of_each_tensor_in_program_order() -> None:
    cfg, plan = _plan("tiny-qwen3")
    writes = 1 + 2 * cfg.num_layers  # hidden: the embedding, then o_proj and down per layer
    assert _entries(plan, "embed") == {"out": (writes, 0)}
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        o_proj, down = 1 + 2 * layer, 2 + 2 * layer
        assert _entries(plan, p + "qkv") == {"x": (writes, o_proj - 1), "out": (1, 0)}
        assert _entries(plan, p + "attention") == {"qkv": (1, 0), "out": (1, 0)}  # split
        assert _entries(plan, p + "o_proj") == {"x": (1, 0), "residual": (writes, o_proj - 1),
                                                "out": (writes, o_proj)}
        assert _entries(plan, p + "gate_up") == {"x": (writes, o_proj), "out": (1, 0)}
        assert _entries(plan, p + "down") == {"x": (1, 0), "residual": (writes, o_proj),
                                              "out": (writes, down)}
    assert _entries(plan, "lm_head") == {"x": (writes, writes - 1)}


def test_epoch_is_never_zero_nor_all_ones() -> None:
    entry = flags.encode_entry(3, 57, 56)
    for step in (0, 1, 2**31 // 57, 2**40):
        e = flags.epoch(entry, step)
        assert 1 <= e <= 2**31
    assert flags.epoch(entry, 0) == 57
    assert flags.epoch(flags.encode_entry(0, 1, 0), 7) == 8
    with pytest.raises(AssertionError):
        flags.encode_entry(0, 4, 4)


@pytest.mark.parametrize("batch", [1, 2])
def test_tensors_touched_by_kinds_without_the_flagged_form_stay_plain(batch: int) -> None:
    _, plan = _plan("tiny-qwen3-moe", batch=batch)
    flagged = {t.name for t in plan.tensors if t.flagged}
    # moe_gate_up reads the norm's output plainly; moe_router writes the routing weights
    # plainly; the ids (int32 words) and the experts' activations are flagged at batch 1 only
    for name in ("mlp_norm", "expert_weights"):
        assert f"layers.0.{name}" not in flagged, name
    for name in ("expert_act", "expert_ids"):
        assert (f"layers.0.{name}" in flagged) == (batch == 1), name


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_moe_experts_poll_the_ids_and_activations_at_batch_1(batch: int) -> None:
    """At batch 1 every moe_gate_up task writes its range of one pair in every step (the K slots
    and the row's K distinct experts pair one to one), so moe_down, which polls every word of
    expert_act, skips its counted wait on gate_up. At batch > 1 a slot past the step's distinct
    experts writes nothing, so the activations stay plain and the wait counted. Likewise
    moe_gate_up polls the router's ids (int32 words) at batch 1 and skips its wait on the
    router; moe_down keeps its wait on the router, whose routing weights it reads plainly."""
    cfg, plan = _plan("tiny-qwen3-moe", batch=batch)
    moe_layers = [i for i in range(cfg.num_layers)
                  if f"layers.{i}.expert_act" in {t.name for t in plan.tensors}]
    assert moe_layers
    recs = _records_by_op(plan)
    for layer in moe_layers:
        p = f"layers.{layer}."
        gate_up, router, norm = (_signals(recs[p + name])
                                 for name in ("experts_gate_up", "router", "post_norm"))
        if batch == 1:
            assert _entries(plan, p + "experts_gate_up")["out"] == (1, 0)
            assert _entries(plan, p + "experts_down")["x"] == (1, 0)
        else:
            assert "out" not in _entries(plan, p + "experts_gate_up")
            assert "x" not in _entries(plan, p + "experts_down")
        for rec in recs[p + "experts_down"]:
            on_gate_up = _polled_waits(rec, gate_up)
            assert on_gate_up and all(w == (batch == 1) for w in on_gate_up), rec
            if batch == 1:  # the router writes ids as words and its weights plainly: the
                # routing weights' readers keep a counted wait (flags.counted_edges)
                on_router = _polled_waits(rec, router)
                assert on_router and not any(on_router), rec
        for rec in recs[p + "experts_gate_up"]:
            on_router = _polled_waits(rec, router)
            assert on_router and all(w == (batch == 1) for w in on_router), rec
            # gate_up stages x (the norm's plain output) before it polls the ids: sound only
            # while its wait on the norm stays counted (moe_gate_up.flag_operands)
            on_norm = _polled_waits(rec, norm)
            assert on_norm and not any(on_norm), rec
        ids = (1, 0) if batch == 1 else None
        assert _entries(plan, p + "router").get("expert_ids") == ids
        assert _entries(plan, p + "experts_gate_up").get("expert_ids") == ids
        assert _entries(plan, p + "experts_down").get("expert_ids") == ids


@pytest.mark.parametrize("batch", [1, 2])
def test_moe_plans_flag_the_residual_stream(batch: int) -> None:
    """rmsnorm polls a flagged x (up to 8 KB: qwen3-30b-a3b at batch 1-2) and moe_down polls
    its residual and writes whole words, so a MoE plan's hidden is flagged like a dense one's:
    the post-attention norm stops waiting on o_proj's counter, the next layer's qkv on
    moe_down's (a reader that sees every word each counted task wrote; rmsnorm and qkv read
    whole rows)."""
    cfg, plan = _plan("tiny-qwen3-moe", batch=batch)
    assert "hidden" in {t.name for t in plan.tensors if t.flagged}
    recs = _records_by_op(plan)
    assert _entries(plan, "layers.0.post_norm") == {"x": _entries(plan, "layers.0.o_proj")["out"]}
    down = _entries(plan, "layers.0.experts_down")
    assert down["residual"] == _entries(plan, "layers.0.o_proj")["out"]
    assert _entries(plan, "layers.1.qkv")["x"] == down["out"]
    for name in ("layers.0.post_norm", "layers.1.qkv"):
        for rec in recs[name]:
            waits = record.decode_waits(rec)
            mask = int(rec[record.POLLED]) & ~record.POLLS
            same_step = [w for w, (_, _, prev) in enumerate(waits) if not prev]
            assert same_step and all(mask >> w & 1 for w in same_step), (name, waits, mask)


@pytest.mark.parametrize("batch", [1, 4])
def test_the_router_polls_its_gate_logits(batch: int) -> None:
    cfg, plan = _plan("tiny-qwen3-moe", batch=batch)
    flagged = {t.name for t in plan.tensors if t.flagged}
    moe_layers = [i for i in range(cfg.num_layers) if f"layers.{i}.router_logits" in
                  {t.name for t in plan.tensors}]
    assert moe_layers
    for layer in moe_layers:
        p = f"layers.{layer}."
        assert p + "router_logits" in flagged
        assert _entries(plan, p + "router")["logits"] == (1, 0)
        assert _entries(plan, p + "router_gate")["out"] == (1, 0)
        for rec in _records_by_op(plan)[p + "router"]:
            waits = record.decode_waits(rec)
            word = int(rec[record.POLLED])
            assert word & record.POLLS  # the storer watches the poll
            mask = word & ~record.POLLS
            # One row: the router sees every word each gate task wrote, so its wait on the gate
            # goes; a row of several sees only its own row of each task's columns: counted.
            # (A previous-step wait is never polled: at batch 1 the router waits for its own
            # last step, whose routing weights, written plainly, it overwrites.)
            same_step = sum(1 << w for w, (_, _, prev) in enumerate(waits) if not prev)
            assert same_step and mask == (same_step if batch == 1 else 0), (waits, mask)


@pytest.mark.parametrize(("rows", "hidden", "polled"),
                         [(1, 2048, True), (2, 2048, True), (3, 2048, False), (1, 60, False)])
def test_rmsnorm_polls_only_an_x_of_two_vectors_a_thread(rows: int, hidden: int,
                                                          polled: bool) -> None:
    graph = Graph()
    graph.add_tensor("x", (rows, hidden), DType.BF16, Role.ACTIVATION)
    graph.add_tensor("w", (hidden,), DType.BF16, Role.WEIGHT)
    graph.add_tensor("y", (rows, hidden), DType.BF16, Role.ACTIVATION)
    graph.add_op("rmsnorm", "norm", (1,), {"x": "x", "weight": "w", "out": "y"})
    (op,) = tile_graph(graph)
    assert get_kind("rmsnorm").flag_operands(op.view) == (frozenset({"x"}) if polled
                                                          else frozenset())


def test_tensor_parallel_ranks_keep_the_residual_plain() -> None:
    plan = rank_plans(get_preset("tiny-qwen3"), DecodeShape(batch=1), 2, num_sms=NUM_SMS)[0]
    flagged = {t.name for t in plan.tensors if t.flagged}
    assert "hidden" not in flagged  # the all-reduce writes it
    assert all(name.endswith((".act", ".qkv", ".attn")) for name in flagged)


@pytest.mark.parametrize(("batch", "expected"), [(1, {"hidden", "act", "qkv", "attn"}),
                                                 (2, {"hidden", "act", "qkv", "attn"}),
                                                 (4, {"hidden", "act", "qkv", "attn"}),
                                                 (8, {"hidden"}), (16, {"hidden"})])
def test_tensors_over_the_byte_limit_stay_plain(batch: int, expected: set[str]) -> None:
    _, plan = _plan("qwen3-0.6b", batch=batch)  # hidden: B x 1024 bf16, act: B x 3072, qkv B x 4096
    flagged = {t.name.split(".")[-1] for t in plan.tensors if t.flagged}
    assert flagged == expected
    assert all(t.device_nbytes <= 2 * flags.FLAG_MAX_BYTES for t in plan.tensors if t.flagged)


@pytest.mark.parametrize(("batch", "flagged"), [(4, True), (8, False)])
def test_attention_flags_its_output_up_to_its_own_limit(batch: int, flagged: bool) -> None:
    # One KV split (4 pages): attention writes attn itself, B x 2048 bf16. At batch 8 (32 KB) the
    # compiler's limit would allow it, the attention kind's (16 KB) does not.
    cfg = get_preset("qwen3-0.6b")
    plan = compile_graph(build_graph(cfg, DecodeShape(batch=batch, max_pages=4)), NUM_SMS)
    attn = [t for t in plan.tensors if t.name.endswith(".attn")]
    assert attn and all(t.flagged == flagged for t in attn)
    assert any(t.flagged for t in plan.tensors if t.name == "hidden")


def test_a_partial_reader_skips_only_a_wait_on_the_tasks_it_sees_whole() -> None:
    """Attention reads its KV head's columns of qkv: it may skip the piece counter of exactly
    the qkv tasks that write them, never a counter of all qkv tasks (some it never sees)."""
    cfg, plan = _plan("qwen3-0.6b", max_pages=4, num_sms=132)
    graph = build_graph(cfg, DecodeShape(max_pages=4), num_sms=132)
    ops = tile_graph(fuse(graph))
    qkv, attention = (next(o for o in ops if o.op.name == f"layers.0.{n}") for n in ("qkv", "attention"))
    tensors = frozenset({"layers.0.qkv"})
    everything = np.arange(qkv.num_tasks)
    assert not flags._skippable(qkv, everything, attention, tensors).any()
    written = next(a for a in qkv.accesses if a.operand == "out").boxes  # [task, dim, lo/hi]
    read = next(a for a in attention.accesses if a.operand == "qkv").boxes
    head0 = np.flatnonzero(written[:, 1, 1] <= read[0, 1, 1])  # the columns of KV head 0
    assert 0 < len(head0) < qkv.num_tasks
    seen = flags._skippable(qkv, head0, attention, tensors)
    assert seen[0] and seen.sum() == 1  # only head 0's task sees all of these
    assert not flags._skippable(qkv, head0[:-1], attention, frozenset()).any()  # plain qkv


def test_plain_writes_of_a_polled_producer_keep_their_counted_waits() -> None:
    """Attention writes attn (flagged: o_proj polls it and skips its wait) and appends to the KV
    cache (plain): the next step's attention, which reads that cache, keeps a counted wait on
    this step's attention instead of one the reduction would drop as implied through o_proj."""
    cfg, plan = _plan("qwen3-0.6b", max_pages=4, num_sms=132)
    recs = _records_by_op(plan)
    assert all(int(rec[record.POLLED]) & 1 for rec in recs["layers.0.o_proj"])
    o_proj_waits = {c for rec in recs["layers.0.o_proj"] for c, _, _ in record.decode_waits(rec)}
    for rec in recs["layers.0.attention"]:
        waits = record.decode_waits(rec)
        mask = int(rec[record.POLLED])
        kept = [w for w, (c, _, prev) in enumerate(waits) if prev and c in o_proj_waits]
        assert len(kept) == 1 and not mask >> kept[0] & 1, (waits, mask)  # counted
    graph = fuse(build_graph(cfg, DecodeShape(max_pages=4), num_sms=132))
    ops = tile_graph(graph)
    edges = find_edges(ops, {n: t.shape for n, t in graph.tensors.items()})
    kept = flags.counted_edges(ops, edges, flags.flagged_tensors(graph, ops))
    names = {(ops[p].op.name, ops[c].op.name, prev) for p, c, prev in kept}
    assert ("layers.0.attention", "layers.0.attention", True) in names
    assert all(ops[p].op.kind == "attention" for p, _, _ in kept)  # linears write one tensor
