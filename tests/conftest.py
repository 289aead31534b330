"""Shared test setup: tests marked `gpu` are skipped without a CUDA device, tests marked `nvcc`
without the nvcc compiler (markers are registered in pyproject.toml)."""

from __future__ import annotations

import shutil
from functools import cache
from pathlib import Path

import pytest

from mpk import env


@cache
def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


@cache
def has_nvcc() -> bool:
    nvcc = env.nvcc_path()
    return Path(nvcc).is_file() or shutil.which(nvcc) is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "gpu" in item.keywords and not has_gpu():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda unavailable)"))
        if "nvcc" in item.keywords and not has_nvcc():
            item.add_marker(pytest.mark.skip(reason=f"needs nvcc (not found: {env.nvcc_path()})"))
