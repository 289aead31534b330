"""Arrival counters (TaskKind.arrivals): attention with several KV splits merges them in the
split whose arrival completes its (row, KV head)'s count, instead of in a merge op after it."""

from __future__ import annotations

import pytest
import torch

from mpk.backends.cpu.interpreter import CpuExecutor
from mpk.compiler import record
from mpk.compiler.lower import compile_graph
from mpk.errors import GraphError
from mpk.models.builder import DecodeShape, build_graph
from mpk.models.config import get_preset
from mpk.tasks.attention.task import MAX_SPLITS
from tests.gpu.test_kernels_attention import attention_problem

KV_HEADS, SPLITS = 2, 4


def split_plan(splits: int = SPLITS, steps: int = 3, lengths=(1, 17, 300)):
    graph, inputs, outputs = attention_problem(2, 64, splits, lengths, steps, kv_heads=KV_HEADS,
                                               seed=splits)
    return compile_graph(graph, num_sms=8), inputs


def run(plan, inputs, steps: int, launches: int = 1, **order) -> CpuExecutor:
    ex = CpuExecutor(plan, **order)
    bound = {name: value.clone() for name, value in inputs.items()}
    for name, value in bound.items():
        ex.bind(name, value)
    for _ in range(launches):
        ex.run(steps)
    ex.bound = bound  # keep the inputs alive with the executor
    return ex


def test_the_arrival_counters_follow_the_dependency_counters_and_nothing_waits_on_them() -> None:
    plan, _ = split_plan()
    first = int(plan.op_params[0, record.ARRIVALS_PARAM])
    groups = KV_HEADS * 3  # 3 rows
    assert first + groups == plan.num_counters
    assert (plan.counter_counts[first:] == SPLITS).all()
    live = [plan.instrs[sm, i] for sm in range(plan.num_sms) for i in range(plan.lengths[sm])]
    waited = {int(c) for rec in live for c, _, _ in record.decode_waits(rec)}
    signalled = {c for rec in live for c in record.decode_signals(rec)}
    assert not (waited | signalled) & set(range(first, plan.num_counters))


def test_one_split_has_no_arrival_counters() -> None:
    plan, _ = split_plan(splits=1)
    assert int(plan.op_params[0, record.ARRIVALS_PARAM]) == -1


def test_each_arrival_counter_holds_its_splits_per_step_across_launches() -> None:
    """Monotonic like the dependency counters: (steps run) x S after every launch."""
    plan, inputs = split_plan(steps=2)
    ex = run(plan, inputs, steps=2, launches=2)
    first = int(plan.op_params[0, record.ARRIVALS_PARAM])
    assert (ex.counters.value[first:] == 4 * SPLITS).all()


def test_the_merge_does_not_depend_on_which_split_arrives_last() -> None:
    """Free orders with opposite priorities make different splits last; out is the same bits
    (the merge sums the splits in split order), and no element stays poisoned."""
    plan, inputs = split_plan(steps=2)
    outs = []
    for sign in (1.0, -1.0):
        ex = run(plan, inputs, steps=2, order="free", priority=lambda t, s=sign: s * t)
        outs.append(ex.read("o"))
    assert not torch.isnan(outs[0]).any()
    assert torch.equal(outs[0], outs[1])


def test_a_row_of_empty_splits_merges_to_zeros() -> None:
    """Length 1 over 4 splits: splits 1-3 attend to nothing (lse -inf); a row past the rope
    table: every split empty, out zeros."""
    graph, inputs, _ = attention_problem(2, 64, SPLITS, (1, 40), 1, kv_heads=KV_HEADS,
                                         max_pos=32, seed=5)
    ex = run(compile_graph(graph, num_sms=8), inputs, steps=1)
    lse, out = ex.read("pl"), ex.read("o")
    assert torch.isinf(lse[0, :, 1:]).all() and torch.isfinite(lse[0, :, 0]).all()
    assert (out[1] == 0).all() and out[0].abs().sum() > 0


def test_too_many_splits_or_no_out_are_refused() -> None:
    with pytest.raises(GraphError, match=f"at most {MAX_SPLITS}"):
        attention_problem(2, 64, MAX_SPLITS + 1, (1, 17), 1, kv_heads=KV_HEADS)
    graph, _, _ = attention_problem(2, 64, SPLITS, (1, 17), 1, kv_heads=KV_HEADS)
    op = graph.ops[0]
    operands = {k: v for k, v in op.operands if k != "out"}
    with pytest.raises(GraphError, match="'out'"):
        graph.add_op("attention", "attn2", op.grid, operands)


def test_the_merged_output_is_flagged_and_polled_and_the_next_steps_splits_wait_counted() -> None:
    """qwen3-0.6b b1 with 16 splits: attn is flagged (the splits' equal out boxes count once in
    covers_whole), o_proj polls it instead of counting attention's tasks, and each attention task
    keeps its counted wait on the previous step's attention (its partials and KV append are
    plain writes: flags.counted_edges), which orders the merging split's reads of the partials
    before the next step's splits overwrite them."""
    plan = compile_graph(build_graph(get_preset("qwen3-0.6b"), DecodeShape(batch=1)), 132)
    assert plan.tensor("layers.1.attn").flagged
    names = [op.name for op in plan.ops]
    producer = {c: names[int(rec[record.OP])] for sm in range(plan.num_sms)
                for rec in plan.instrs[sm, :plan.lengths[sm]] for c in record.decode_signals(rec)}
    seen = set()
    for sm in range(plan.num_sms):
        for rec in plan.instrs[sm, :plan.lengths[sm]]:
            name = names[int(rec[record.OP])]
            waits = [(producer[c], bool(prev), bool(int(rec[record.POLLED]) >> w & 1))
                     for w, (c, _, prev) in enumerate(record.decode_waits(rec))]
            if name == "layers.1.o_proj":
                assert ("layers.1.attention", False, True) in waits
                seen.add(name)
            if name == "layers.1.attention":
                assert ("layers.1.attention", True, False) in waits
                seen.add(name)
    assert seen == {"layers.1.o_proj", "layers.1.attention"}


def context_plan(splits: int = SPLITS, split_positions: int = 16, lengths=(1, 31, 40, 300),
                 steps: int = 3):
    """attention_problem whose rows use 1 / 1-then-3 / 3 / 4 of the splits (effective_splits at
    16 positions a split: one up to 32 positions)."""
    graph, inputs, _ = attention_problem(2, 64, splits, lengths, steps, kv_heads=KV_HEADS,
                                         seed=7, split_positions=split_positions)
    return compile_graph(graph, num_sms=8), inputs


def test_rows_use_the_splits_their_context_needs() -> None:
    """Row 0 (1-3 positions) and row 1 (31-33) use one split until row 1 reaches 33: split 0
    writes out, no split arrives, so their counters hold 0 and S (one step of arrivals); rows
    2 and 3 arrive every step. The unused splits' partials are never written (still poison),
    and out has no NaN: the merge reads only the used splits."""
    plan, inputs = context_plan()
    ex = CpuExecutor(plan, poison=True)
    bound = {name: value.clone() for name, value in inputs.items()}
    for name, value in bound.items():
        ex.bind(name, value)
    ex.run(3)
    first = int(plan.op_params[0, record.ARRIVALS_PARAM])
    counters = ex.counters.value[first:].reshape(4, KV_HEADS)  # (row, KV head)
    assert counters.tolist() == [[0, 0], [SPLITS, SPLITS], [3 * SPLITS] * 2, [3 * SPLITS] * 2]
    po, out = ex.read("po"), ex.read("o")
    assert torch.isnan(po[0]).all()  # never used several splits
    assert torch.isnan(po[1, :, 3]).all() and not torch.isnan(po[1, :, :3]).any()
    assert torch.isnan(po[2, :, 3]).all() and not torch.isnan(po[3]).any()
    assert not torch.isnan(out).any()


def test_fewer_splits_give_what_one_split_gives() -> None:
    """Against the same problem with one split: row 0 (one split every step) has the same out
    bits; the merged rows agree to bf16 rounding (fp32 partials, another sum order), so no
    position is lost or counted twice when the row's splits change between steps."""
    outs, caches = [], []
    for splits in (1, SPLITS):
        plan, inputs = context_plan(splits=splits)
        ex = run(plan, inputs, steps=3)
        outs.append(ex.read("o").float())
        caches.append((ex.read("k_cache"), ex.read("v_cache")))
    one, several = outs
    assert torch.equal(one[0], several[0])
    error = (one[1:] - several[1:]).norm() / one[1:].norm()
    assert error <= 2.0 ** -8  # bf16's half ulp, relative
    assert all(torch.equal(a, b) for a, b in zip(*caches))


def test_split_order_does_not_matter_when_rows_use_fewer_splits() -> None:
    plan, inputs = context_plan()
    outs = [run(plan, inputs, steps=3, order="free", priority=lambda t, s=sign: s * t).read("o")
            for sign in (1.0, -1.0)]
    assert torch.equal(outs[0], outs[1])


def test_a_negative_split_positions_is_refused() -> None:
    with pytest.raises(GraphError, match="split_positions"):
        attention_problem(2, 64, SPLITS, (1, 17), 1, kv_heads=KV_HEADS, split_positions=-1)


def test_rewound_rows_go_back_to_fewer_splits() -> None:
    """The engine rewinds positions between launches: the same three steps again (rows back to
    one split, row 1 crossing to three again) give the same out bits, and each counter that
    arrived counts the second launch's arrivals too."""
    plan, inputs = context_plan()
    ex = run(plan, inputs, steps=3)
    first_out = ex.read("o").clone()
    ex.write("positions", inputs["positions"])
    ex.run(3)
    assert torch.equal(ex.read("o"), first_out)
    first = int(plan.op_params[0, record.ARRIVALS_PARAM])
    counters = ex.counters.value[first:].reshape(4, KV_HEADS)
    assert counters.tolist() == [[0, 0], [2 * SPLITS] * 2, [6 * SPLITS] * 2, [6 * SPLITS] * 2]


def test_a_row_outside_the_rope_table_uses_one_split() -> None:
    """With split_positions, a row past the rope table is a one-position context: split 0
    writes zeros to out and no split arrives."""
    graph, inputs, _ = attention_problem(2, 64, SPLITS, (5, 40), 1, kv_heads=KV_HEADS,
                                         max_pos=32, seed=5, split_positions=16)
    plan = compile_graph(graph, num_sms=8)
    ex = run(plan, inputs, steps=1)
    out = ex.read("o")
    assert (out[1] == 0).all() and out[0].abs().sum() > 0
    first = int(plan.op_params[0, record.ARRIVALS_PARAM])
    assert (ex.counters.value[first:] == 0).all()
