"""What every backend offers the engine: bind tensors, write inputs, run steps, read results.

Step semantics (shared by all backends): a backend keeps a global step counter g, starting at 0.
`run(n)` executes decode steps g .. g+n-1 in one go; inside that launch the tasks see the LOCAL step
s = 0 .. n-1 (positions are positions[b] + s, prompt row s, tokens_out row s). Dependency counters
are monotonic: after global step g has finished, counter c holds (g+1) * counter_counts[c]. A wait
(c, count, prev) in global step g needs counter c >= (g + 1 - prev) * count.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mpk.compiler.plan import Plan


class Executor(Protocol):
    plan: Plan

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        """Attach user-owned storage for a WEIGHT or IO tensor (no copy where possible)."""

    def write(self, name: str, value: torch.Tensor) -> None:
        """Copy `value` into a bound IO tensor or an arena tensor."""

    def read(self, name: str) -> torch.Tensor:
        """A CPU copy of a tensor's current contents."""

    def run(self, num_steps: int = 1) -> None:
        """Execute `num_steps` decode steps in one launch."""
