"""One tensor-parallel rank per PROCESS on the CPU interpreter: the all-reduce over a real
process group (torch.distributed, gloo).

MultiRankCpuExecutor (mpk.testing) runs G ranks in one process and is the tool for proving the
cross-rank waits. This module is the other half: the process model that `mpk generate --tp G`
uses, where each process owns one rank's Plan, weights and KV cache, exactly as each GPU will.
A rank's CpuExecutor hands every `allreduce` tile the peers' partials by an all-gather of that
tile across the group.

Why the collectives match up: every rank runs the same Plan structure in the interpreter's
deterministic "schedule" order, so the k-th all-reduce tile a rank reaches is the k-th on every
rank. That is checked, not assumed: each exchange also carries (task, count) and a mismatch
raises instead of summing unrelated tiles.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mpk.backends.cpu.interpreter import CpuExecutor
from mpk.compiler.plan import Plan
from mpk.errors import MpkError
from mpk.tasks.base import grid_points

REDUCE_KIND = "allreduce"  # the task kind whose tiles exchange partials across ranks


class GroupAllReduce:
    """The CpuExecutor `tile_extra` hook of one rank: peers' partials by all-gather."""

    def __init__(self, plan: Plan, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise MpkError("GroupAllReduce needs torch.distributed initialised (one process "
                           "per rank); see mpk.parallel.launch.run_ranks")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._tasks: set[int] = set()
        for op in plan.ops:
            if op.kind != REDUCE_KIND:
                continue
            ranks = dict(op.attrs)["ranks"]
            if ranks != self.size:
                raise MpkError(f"allreduce {op.name!r} sums {ranks} ranks, but the process "
                               f"group has {self.size}")
            self._tasks.update(range(op.first_task, op.first_task + len(grid_points(op.grid))))
        self._count = 0

    def __call__(self, task: int, views: dict[str, torch.Tensor]) -> dict[str, object]:
        if task not in self._tasks:
            return {}
        self._count += 1
        own = views["partial"]
        # One collective per tile: the tile (exact in float64) followed by (task, count).
        mine = torch.cat([own.double().reshape(-1),
                          torch.tensor([task, self._count], dtype=torch.float64)])
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(gathered, mine, group=self.group)
        tags = [tuple(int(x) for x in g[-2:]) for g in gathered]
        if any(tag != (task, self._count) for tag in tags):
            raise MpkError(f"rank {self.rank}: the ranks reached different all-reduce tiles "
                           f"(task, count) {tags}; every rank must run the same Plan")
        return {"peers": [g[:-2].reshape(own.shape).to(own.dtype) for g in gathered]}


def rank_executor(plan: Plan, poison: bool = True) -> CpuExecutor:
    """This process's rank of a tensor-parallel Plan on the interpreter (schedule order)."""
    return CpuExecutor(plan, order="schedule", poison=poison, tile_extra=GroupAllReduce(plan))
