"""Flagged activations on the GPU (compiler/flags.py): a consumer that polls the data itself,
and the watchdog when the data never carries the epoch it expects. The values themselves are
checked by test_model_gpu.py (every buffer against the interpreter; read() strips the epochs)."""

from __future__ import annotations

import time

import pytest
import torch

from mpk.backends.registry import create_executor
from mpk.compiler import flags, record
from mpk.engine.bind import bind_model
from mpk.errors import KernelHangError, MpkError
from mpk.models.builder import DecodeShape
from mpk.models.config import get_preset
from mpk.models.weights import random_weights
from mpk.tasks.registry import get_kind
from tests.interp.model_run import make_plan

pytestmark = pytest.mark.gpu
SEED = 20261202


def _flag_slot(plan, op_index: int, operand: str) -> int:
    names = [s.name for s in get_kind(plan.ops[op_index].kind).operands]
    for e in range(record.FLAG_ENTRIES):
        decoded = flags.decode_entry(int(plan.op_params[op_index, record.FLAG_PARAMS + e]))
        if decoded is not None and names[decoded[0]] == operand:
            return record.FLAG_PARAMS + e
    raise AssertionError(f"{plan.ops[op_index].name} has no flagged {operand}")


def test_a_poll_that_never_sees_its_epoch_names_the_task() -> None:
    cfg = get_preset("tiny-qwen3")
    shape = DecodeShape(batch=1)
    plan = make_plan(cfg, shape, num_sms=132)
    op = [o.name for o in plan.ops].index("layers.0.gate_up")
    word = _flag_slot(plan, op, "x")
    # x now expects the NEXT write of hidden (down's, which waits on this very op): never seen.
    plan.op_params[op, word] += 1 << 20
    ex = create_executor(plan, "cuda", timeout_s=1.0)
    bind_model(ex, plan, cfg, shape, random_weights(cfg, seed=SEED), SEED)
    start = time.monotonic()
    with pytest.raises(KernelHangError) as info:
        ex.run(1)
    assert time.monotonic() - start < 20
    message = str(info.value)
    assert "layers.0.gate_up" in message and "polled its flagged input" in message, message
    assert "epochs their writes carry" in message, message  # o_proj finished: a root cause
    with pytest.raises(MpkError, match="cannot run again"):
        ex.run(1)
    assert torch.ones(1000, device="cuda").sum().item() == 1000  # the GPU is still usable


def test_flagged_tensors_are_read_as_values_and_never_written_by_the_host() -> None:
    cfg = get_preset("tiny-qwen3")
    shape = DecodeShape(batch=1)
    plan = make_plan(cfg, shape, num_sms=132)
    ex = create_executor(plan, "cuda", poison=True)
    bind_model(ex, plan, cfg, shape, random_weights(cfg, seed=SEED), SEED)
    ex.run(1)
    hidden = ex.read("hidden")
    assert hidden.dtype == torch.bfloat16 and hidden.shape == (1, cfg.hidden_size)
    assert torch.isfinite(hidden.float()).all()  # written (a poisoned word would read NaN)
    with pytest.raises(MpkError, match="flagged activation"):
        ex.write("hidden", torch.zeros_like(hidden))
