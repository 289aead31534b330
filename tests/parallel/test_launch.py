"""One process per tensor-parallel rank (mpk.parallel.launch, mpk.parallel.group): the process
model of `mpk generate --tp G`, on the CPU interpreter over a gloo process group."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.distributed as dist

from mpk import env
from mpk.cli import main
from mpk.engine.job import GenerateJob, ModelSource, run_job
from mpk.errors import MpkError, UnsupportedError
from mpk.models import get_preset
from mpk.models.builder import DecodeShape
from mpk.models.reference import ReferenceModel
from mpk.models.weights import random_weights
from mpk.parallel import TensorParallel, rank_plans
from mpk.parallel.group import GroupAllReduce
from mpk.parallel.launch import RankFailedError, run_ranks
from mpk.testing import greedy_mismatches

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]
NEW = 8


def _who(tp: TensorParallel) -> list[tuple[int, int, dict[str, str | None]]]:
    """Every rank's (rank, world size, multicast variables), gathered to each rank."""
    mine = (tp.rank, dist.get_world_size(), {k: os.environ.get(k) for k in env.MULTICAST_OFF})
    out: list = [None] * tp.size
    dist.all_gather_object(out, mine)
    return out


def test_every_rank_runs_in_its_own_group_with_multicast_off() -> None:
    got = run_ranks(2, _who)
    assert [(rank, size) for rank, size, _ in got] == [(0, 2), (1, 2)]
    assert all(variables == env.MULTICAST_OFF for _, _, variables in got)


def _rank_one_raises(tp: TensorParallel) -> None:
    if tp.rank == 1:
        raise ValueError("rank one is broken")
    dist.barrier()  # rank 0 waits on its dead peer: the launcher must not wait with it


def _rank_one_dies(tp: TensorParallel) -> None:
    if tp.rank == 1:
        os._exit(3)
    dist.barrier()


def test_a_failing_rank_is_named_and_stops_the_others() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 failed: ValueError: rank one is broken"):
        run_ranks(2, _rank_one_raises)
    with pytest.raises(RankFailedError, match="rank 1 exited with code 3"):
        run_ranks(2, _rank_one_dies)
    assert time.monotonic() - start < 60


def test_multicast_left_on_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    with pytest.raises(UnsupportedError, match="TORCH_SYMM_MEM_DISABLE_MULTICAST=0"):
        run_ranks(2, _who)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_two_rank_generation_matches_the_reference(preset: str) -> None:
    cfg = get_preset(preset)
    job = GenerateJob(ModelSource(cfg, seed=5), PROMPTS, NEW, steps_per_launch=4,
                      max_seq_len=16, progress=False)
    got = run_job(job, tp_size=2)
    assert [len(row) for row in got.token_ids] == [NEW, NEW]
    ref = ReferenceModel(cfg, random_weights(cfg, 5), max_seq=16)
    assert not greedy_mismatches(ref, PROMPTS, got.token_ids)


def test_cli_generate_with_tp(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--model", "tiny-llama", "--backend", "cpu", "--tp", "2",
                 "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--json"])
    out = json.loads(capsys.readouterr().out)  # rank 0 alone prints
    assert code == 0 and out["tp"] == 2 and len(out["token_ids"][0]) == 4


def _mismatched_exchange(tp: TensorParallel) -> None:
    cfg = get_preset("tiny-qwen3")
    shape = DecodeShape(batch=1, steps_per_launch=1, page_size=4, max_pages=2, num_pages=2)
    plan = rank_plans(cfg, shape, 2, num_sms=2)[tp.rank]
    tasks = sorted(i for i, op in enumerate(plan.ops) if op.kind == "allreduce")
    task = plan.ops[tasks[tp.rank]].first_task  # rank 0 and rank 1 at different all-reduces
    GroupAllReduce(plan)(task, {"partial": torch.zeros(1, cfg.hidden_size)})


def test_ranks_at_different_allreduce_tiles_are_caught() -> None:
    with pytest.raises(MpkError, match="reached different all-reduce tiles"):
        run_ranks(2, _mismatched_exchange)
