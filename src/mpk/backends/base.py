"""What every backend offers the engine: bind tensors, write inputs, run steps, read results.

Step semantics (shared by all backends): a backend keeps a global step counter g, starting at 0.
`run(n)` executes decode steps g .. g+n-1 in one go; inside that launch the tasks see the LOCAL step
s = 0 .. n-1 (positions are positions[b] + s, prompt row s, tokens_out row s). Dependency counters
are monotonic: after global step g has finished, counter c holds (g+1) * counter_counts[c]. A wait
(c, count, prev) in global step g needs counter c >= (g + 1 - prev) * count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from mpk.compiler.plan import Plan


class Executor(Protocol):
    plan: Plan

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        """Attach user-owned storage for a WEIGHT or IO tensor (no copy where possible)."""

    def write(self, name: str, value: torch.Tensor) -> None:
        """Copy `value` into a bound IO tensor or an arena tensor, in order with the launches:
        after every launch started before it, before every launch started after it."""

    def read(self, name: str) -> torch.Tensor:
        """A CPU copy of a tensor's current contents."""

    def run(self, num_steps: int = 1) -> None:
        """Execute `num_steps` decode steps in one launch."""


class Launch(Protocol):
    """A launch started by `start`."""

    def wait(self) -> dict[str, torch.Tensor]:
        """Block until the launch has finished (raising its failure, if any); the host copies of
        the tensors it was asked to read, as the launch left them."""


@runtime_checkable
class StartsLaunches(Protocol):
    """An executor that returns from a launch while the device runs it (CudaExecutor)."""

    def start(self, num_steps: int, reads: Sequence[str] = ()) -> Launch:
        """Start `num_steps` steps in one launch and the copies of `reads` taken after it."""


class _Finished:
    def __init__(self, results: dict[str, torch.Tensor]) -> None:
        self._results = results

    def wait(self) -> dict[str, torch.Tensor]:
        return self._results


def overlaps(executor: Executor) -> bool:
    """Whether `executor` returns from `start` while the device runs the launch."""
    return isinstance(executor, StartsLaunches)


def start(executor: Executor, num_steps: int, reads: Sequence[str] = ()) -> Launch:
    """Start a launch of `num_steps` steps on `executor` and the host copies of `reads` taken at
    its end. The host may write the next launch's inputs and start it before this one's wait():
    an executor that overlaps returns at once; any other runs the launch here."""
    if isinstance(executor, StartsLaunches):
        return executor.start(num_steps, reads)
    executor.run(num_steps)
    return _Finished({name: executor.read(name) for name in reads})
