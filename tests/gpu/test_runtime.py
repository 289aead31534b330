"""The CUDA runtime on a real GPU, with stub task code (tests/cuda/stub_kinds): dependency
counters across SMs, steps and launches, the watchdog, and the executor's error handling."""

from __future__ import annotations

import time

import pytest
import torch

from mpk.backends.cuda.executor import CudaExecutor
from mpk.compiler import record
from mpk.errors import KernelHangError, MpkError
from tests.cuda.runtime_plans import STUB_KINDS, chain_expected, chain_plan, patch_record

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]
N, TILES = 1 << 16, 64


def executor(plan, **options) -> CudaExecutor:
    return CudaExecutor(plan, extra_includes=[STUB_KINDS], **options)


def fresh_a() -> torch.Tensor:
    return torch.arange(N, dtype=torch.int32)


@pytest.mark.parametrize("num_sms", [1, 32, 0])  # 0 = every SM of the device
def test_chain_across_sms_steps_and_launches(num_sms: int) -> None:
    num_sms = num_sms or torch.cuda.get_device_properties(0).multi_processor_count
    plan = chain_plan(N, TILES, num_sms)
    ex = executor(plan, timeout_s=5)
    assert ex.kernel_info.blocks_per_sm >= 1
    a0 = fresh_a()
    ex.bind("a", a0.cuda())
    ex.run(3)
    ex.run(1)
    ex.run(2)
    assert ex.step == 6
    assert torch.equal(ex.read("a"), chain_expected(a0, TILES, 6))
    assert ex.counters.tolist() == [6 * TILES] * 3  # monotonic, never reset


def test_bind_write_read_and_poison() -> None:
    ex = executor(chain_plan(N, TILES, 8), poison=True)
    assert (ex.read("b") == -1).all()  # 0xFF bytes
    with pytest.raises(MpkError, match="bind these tensors before run\\(\\): a"):
        ex.run(1)
    with pytest.raises(MpkError, match="'a'.*expected shape"):
        ex.bind("a", torch.zeros(N, dtype=torch.float32))
    with pytest.raises(MpkError, match="activation"):
        ex.bind("b", torch.zeros(N, dtype=torch.int32))
    with pytest.raises(MpkError, match="no tensor named 'zz'"):
        ex.read("zz")
    ex.bind("a", torch.zeros(N, dtype=torch.int32))  # a CPU tensor: copied to the device
    ex.write("a", fresh_a())
    ex.run(2)
    assert torch.equal(ex.read("a"), chain_expected(fresh_a(), TILES, 2))


def test_bind_copies_a_view_off_a_16_byte_boundary() -> None:
    """The kinds' 16-byte vector paths need aligned bound operands (rmsnorm with a flagged x
    has no other path): such a view is copied, and the kernel runs on the copy."""
    ex = executor(chain_plan(N, TILES, 8))
    view = torch.zeros(N + 1, dtype=torch.int32, device="cuda")[1:]
    assert view.data_ptr() % 16 and view.is_contiguous()
    view.copy_(fresh_a())
    ex.bind("a", view)
    assert ex.tensor("a").data_ptr() % 16 == 0
    ex.run(2)
    assert torch.equal(ex.read("a"), chain_expected(fresh_a(), TILES, 2))
    assert torch.equal(view.cpu(), fresh_a())  # the caller's view is left as it was


def test_watchdog_names_the_stuck_task_and_the_gpu_survives() -> None:
    plan = chain_plan(N, TILES, 32)
    task = TILES + 3  # inc1[3]: make its wait impossible to satisfy
    stuck = patch_record(plan, task, record.WAITS + 1, 1 << 30)
    ex = executor(stuck, timeout_s=1.0)
    ex.bind("a", fresh_a().cuda())
    start = time.monotonic()
    with pytest.raises(KernelHangError) as info:
        ex.run(2)
    assert time.monotonic() - start < 10
    message = str(info.value)
    sm, _ = plan.locate(task)
    assert plan.task_name(task) in message and f"SM {sm}" in message, message
    assert "counter 0" in message and "global step 0" in message, message
    with pytest.raises(MpkError, match="cannot run again"):
        ex.run(1)
    # The GPU is still usable, and a fresh executor of the good plan runs correctly.
    assert torch.ones(1000, device="cuda").sum().item() == 1000
    good = executor(plan, timeout_s=5)
    good.bind("a", fresh_a().cuda())
    good.run(2)
    assert torch.equal(good.read("a"), chain_expected(fresh_a(), TILES, 2))


def test_unknown_kind_stops_every_cta() -> None:
    plan = chain_plan(N, TILES, 32)
    bad = patch_record(plan, 5, record.KIND, 7)
    ex = executor(bad, timeout_s=2.0)
    ex.bind("a", fresh_a().cuda())
    start = time.monotonic()
    with pytest.raises(MpkError, match="kind id 7"):
        ex.run(1)
    assert time.monotonic() - start < 10
    assert torch.ones(10, device="cuda").sum().item() == 10
