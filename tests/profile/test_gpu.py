"""The profiling build on a real GPU: stamps from the runtime (stub kernels) and `mpk profile`
end to end on a tiny model. Skipped without a GPU."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mpk.backends.cuda.executor import CudaExecutor
from mpk.errors import MpkError
from mpk.profile.picture import PNG_MAGIC
from mpk.profile.timeline import NUM_STAMPS, from_stamps
from tests.cuda.runtime_plans import CHAIN_OPS, STUB_KINDS, chain_expected, chain_plan

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]
N, TILES, SMS = 1 << 16, 64, 16


def test_profiled_chain_gives_the_same_result_and_ordered_stamps() -> None:
    plan = chain_plan(N, TILES, SMS)
    plain = CudaExecutor(plan, extra_includes=[STUB_KINDS])
    profiled = CudaExecutor(plan, extra_includes=[STUB_KINDS], profile=True)
    assert profiled.kernel.profiling and not plain.kernel.profiling
    assert profiled.build.key != plain.build.key
    with pytest.raises(MpkError, match="profile=True"):
        plain.last_profile()
    a0 = torch.arange(N, dtype=torch.int32)
    for ex in (plain, profiled):
        ex.bind("a", a0.cuda())
        ex.run(2)
        ex.run(3)
        assert torch.equal(ex.read("a"), chain_expected(a0, TILES, 5))
    stamps, step_begin = profiled.last_profile()
    assert step_begin == 2 and stamps.shape == (3, SMS, int(plan.lengths.max()), NUM_STAMPS)
    tl = from_stamps(stamps, plan, step_begin)
    assert len(tl) == plan.num_tasks * 3 and tl.missing == 0
    # %globaltimer ticks coarsely (about 1 us) and a stub task is shorter, so a single task's
    # run time may read 0; the stamps must still be ordered and the total positive.
    assert (tl.wait_ns >= 0).all() and (tl.run_ns >= 0).all() and tl.run_ns.sum() > 0
    # The controller's READY precedes the consumers' RUN; DONE lies between RUN and END.
    assert (tl.seen_ns <= tl.ready_ns).all() and (tl.ready_ns <= tl.done_ns).all()
    assert (tl.done_ns <= tl.end_ns).all()
    names = tl.op_names()
    for s in range(3):  # inc1 waits for every inc0 task of its step, inc2 for every inc1
        for before, after in itertools.pairwise(CHAIN_OPS):
            first = tl.ready_ns[(tl.step == s) & (names == after)].min()
            assert first >= tl.ready_ns[(tl.step == s) & (names == before)].max()


def test_profile_model_end_to_end(tmp_path: Path) -> None:
    from mpk.models.config import get_preset
    from mpk.profile.run import KINDS_FILE, PICTURE_FILE, TRACE_FILE, profile_model

    result = profile_model(get_preset("tiny-llama"), steps=8, out_dir=tmp_path, repeats=3,
                           num_sms=16, measure_bandwidth=False)
    assert (tmp_path / PICTURE_FILE).read_bytes().startswith(PNG_MAGIC)
    assert json.loads((tmp_path / TRACE_FILE).read_text())["traceEvents"]
    summary = json.loads((tmp_path / KINDS_FILE).read_text())
    assert summary["missing_records"] == 0
    assert summary["kinds"]["total"]["tasks"] == result.plan.num_tasks * 8
    t = result.timing
    assert t["ms_per_token"] > 0 and np.isfinite(t["profiling_overhead_pct"])
    # The stamps cover the kernel only; event timing adds the launch: same order of magnitude.
    assert 0.2 * t["profiled_ms_per_token"] < t["stamps_ms_per_token"] <= 1.5 * t[
        "profiled_ms_per_token"]
    # The chain table: every layer op role, and the linear kind's marks inside its body.
    roles = {r["role"] for r in summary["phases"]["rows"]}
    assert {"layers.*.qkv", "layers.*.attention", "layers.*.down", "lm_head"} <= roles
    tl = result.timeline
    lin = tl.kind_names() == "linear"
    assert (tl.ready_ns[lin] <= tl.input_ns[lin]).all()
    assert (tl.input_ns[lin] <= tl.compute_ns[lin]).all()
    assert (tl.compute_ns[lin] <= tl.done_ns[lin]).all()
