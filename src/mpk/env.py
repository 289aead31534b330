"""The only module that reads environment variables. Each one is listed here with its meaning."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """MPK_CACHE_DIR: where built megakernels are kept (default ~/.cache/mpk)."""
    return Path(os.environ.get("MPK_CACHE_DIR", Path.home() / ".cache" / "mpk"))


def nvcc_path() -> str:
    """MPK_NVCC: the nvcc to use (default: CUDA_HOME/bin/nvcc, else nvcc on PATH)."""
    if "MPK_NVCC" in os.environ:
        return os.environ["MPK_NVCC"]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    for candidate in ("/usr/local/cuda/bin/nvcc",):
        if Path(candidate).exists() and not _on_path("nvcc"):
            return candidate
    return "nvcc"


def watchdog_seconds() -> float:
    """MPK_WATCHDOG_S: how long one wait inside the megakernel may spin before it aborts (default 5)."""
    return float(os.environ.get("MPK_WATCHDOG_S", "5"))


def _on_path(name: str) -> bool:
    return any((Path(p) / name).exists() for p in os.environ.get("PATH", "").split(os.pathsep) if p)
