"""Timing decode loops on a GPU, the read-bandwidth ceiling and the bandwidth floor.

Batch-small decode is bound by reading the weights once per token, so the floor of a step is
bytes_per_token / read_bandwidth, with the bandwidth measured on the card at hand (a datasheet
number flatters nobody). Times come from CUDA events around a whole loop of steps: the host
launch overhead of each step counts, because it is part of what a system costs per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from mpk.errors import UnsupportedError

#: Runs n decode steps (queued on the current stream; it need not synchronize).
RunSteps = Callable[[int], object]


def require_cuda(what: str) -> None:
    """Raise UnsupportedError naming `what` when no CUDA device is usable."""
    if not torch.cuda.is_available():
        raise UnsupportedError(f"{what} needs a CUDA GPU, but torch.cuda.is_available() is "
                               f"False (torch {torch.__version__})")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics, as
    numpy's default method; exact for a median of an odd count."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(ms_per_token: Sequence[float]) -> dict[str, float]:
    """median / p10 / p90 of per-token times."""
    return {"median_ms": percentile(ms_per_token, 50), "p10_ms": percentile(ms_per_token, 10),
            "p90_ms": percentile(ms_per_token, 90)}


def time_decode(step_fn: RunSteps, num_steps: int, warmup: int = 1, repeats: int = 3,
                reset: Callable[[], object] | None = None) -> dict[str, object]:
    """ms per token of `step_fn(num_steps)` (which runs num_steps decode steps).

    `warmup` untimed runs come first (compilation, graph capture, allocator growth); then
    `repeats` runs, each timed with CUDA events around the whole loop. `reset` (e.g. rewind
    the position) runs before each, outside the timed region. Returns median/p10/p90 ms per
    token and the raw per-run values."""
    require_cuda("time_decode")
    if num_steps <= 0 or repeats <= 0 or warmup < 0:
        raise ValueError(f"time_decode needs num_steps > 0, repeats > 0, warmup >= 0; got "
                         f"{num_steps}, {repeats}, {warmup}")
    for _ in range(warmup):
        if reset is not None:
            reset()
        step_fn(num_steps)
    torch.cuda.synchronize()
    runs: list[float] = []
    for _ in range(repeats):
        if reset is not None:
            reset()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        step_fn(num_steps)
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / num_steps)
    return {**summarize(runs), "runs_ms": runs, "num_steps": num_steps, "repeats": repeats}


def read_bandwidth_probe(device: torch.device | str | int | None = None,
                         nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Achievable read bandwidth in bytes/s: torch.sum over `nbytes` of random bf16, the
    median of `repeats` event-timed sums after a warm-up.

    2 GiB is far beyond the 50 MB L2, so every byte comes from HBM; random data rather than
    zeros because zeros can run faster than real data."""
    require_cuda("read_bandwidth_probe")
    device = torch.device("cuda" if device is None else device)
    if isinstance(device, torch.device) and device.type != "cuda":
        raise UnsupportedError(f"read_bandwidth_probe needs a CUDA device, got {device}")
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(nbytes // 2, generator=gen, dtype=torch.bfloat16, device=device)
    with torch.cuda.device(device):
        for _ in range(3):
            x.sum()
        torch.cuda.synchronize()
        times: list[float] = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            x.sum()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    read = x.numel() * x.element_size()
    del x
    torch.cuda.empty_cache()
    return read / (percentile(times, 50) / 1e3)


def floor_ms(bytes_per_token: float, bandwidth: float) -> float:
    """The bandwidth floor of one decode step in ms: bytes read per token / bytes per second."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    return bytes_per_token / bandwidth * 1e3


def percent_of_floor(floor: float, ms_per_token: float) -> float:
    """How close a system gets to the floor: 100 * floor / measured (100% = at the floor)."""
    if ms_per_token <= 0:
        raise ValueError(f"ms_per_token must be positive, got {ms_per_token}")
    return 100.0 * floor / ms_per_token
