"""The only module that reads environment variables. Each one is listed here with its meaning."""

from __future__ import annotations

import os
from pathlib import Path

from mpk.errors import UnsupportedError


def cache_dir() -> Path:
    """MPK_CACHE_DIR: where built megakernels and downloaded models (models/) are kept
    (default ~/.cache/mpk)."""
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


def api_key() -> str | None:
    """MPK_API_KEY: the key `mpk serve` requires when --api-key is not given (a key on the
    command line shows in `ps`; one in the environment does not). Unset or empty: no key."""
    return os.environ.get("MPK_API_KEY") or None


def watchdog_seconds() -> float:
    """MPK_WATCHDOG_S: how long one wait inside the megakernel may spin before it aborts (default 5)."""
    return float(os.environ.get("MPK_WATCHDOG_S", "5"))


# NVLink multicast (NVLS) can take a shared host's GPUs out of service: every process MPK starts
# for tensor parallelism runs with it off in NCCL, torch's symmetric memory and NVSHMEM.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


def disable_multicast() -> None:
    """Set MULTICAST_OFF in this process (children inherit it). A variable already set to
    another value is refused, not overridden silently: MPK never runs with multicast on."""
    for name, value in MULTICAST_OFF.items():
        current = os.environ.get(name)
        if current is not None and current != value:
            raise UnsupportedError(f"{name}={current} would allow NVLink multicast, which MPK "
                                   f"never uses (it can take shared GPUs out of service); unset "
                                   f"it or set {name}={value}")
        os.environ[name] = value


def _on_path(name: str) -> bool:
    return any((Path(p) / name).exists() for p in os.environ.get("PATH", "").split(os.pathsep) if p)
