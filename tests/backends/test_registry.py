"""The backend registry: names, devices and SM counts in one place, and clear errors."""

from __future__ import annotations

import pytest
import torch

import mpk.cli
import mpk.engine.job as job_module
from mpk.backends.cpu.interpreter import CpuExecutor
from mpk.backends.registry import BACKEND_NAMES, CPU_NUM_SMS, create_executor, get_backend
from mpk.compiler.lower import compile_graph
from mpk.errors import MpkError, UnsupportedError
from mpk.graph.graph import DEFAULT_NUM_SMS
from mpk.models import get_preset
from mpk.models.builder import DecodeShape, build_graph


def test_names_and_unknown_backend() -> None:
    assert BACKEND_NAMES == ("cpu", "cuda")
    with pytest.raises(UnsupportedError, match="unknown backend 'tpu'.*'cpu', 'cuda'"):
        get_backend("tpu")


def test_cpu_backend_device_and_sms() -> None:
    cpu = get_backend("cpu")
    assert cpu.device() == torch.device("cpu")
    assert cpu.num_sms() == CPU_NUM_SMS
    with pytest.raises(MpkError, match="runs on a cpu device"):
        cpu.device("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answers")
def test_cuda_backend_without_a_gpu() -> None:
    cuda = get_backend("cuda")
    assert cuda.num_sms() == DEFAULT_NUM_SMS  # the plan target when no GPU says otherwise
    with pytest.raises(UnsupportedError, match="needs a CUDA GPU"):
        cuda.device()


def test_create_executor_builds_the_interpreter() -> None:
    plan = compile_graph(build_graph(get_preset("tiny-llama"), DecodeShape(batch=1)), 2)
    assert isinstance(create_executor(plan, "cpu"), CpuExecutor)
    with pytest.raises(UnsupportedError, match="unknown backend"):
        create_executor(plan, "gpu")


def test_cli_plan_default_is_the_graph_default() -> None:
    assert mpk.cli.PLAN_NUM_SMS == DEFAULT_NUM_SMS


def test_one_rank_runs_the_engine_without_the_parallel_launcher(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_launcher(*args: object, **kwargs: object) -> None:
        raise AssertionError("a one-process run went through the parallel launcher")

    monkeypatch.setattr(job_module, "run_ranks", no_launcher)
    cfg = get_preset("tiny-llama")
    job = job_module.GenerateJob(source=job_module.ModelSource(cfg), backend="cpu",
                                 prompts=[[1, 2, 3]], max_new_tokens=2, progress=False)
    result = job_module.run_job(job)
    assert len(result.token_ids[0]) == 2
