"""The activation arena of one tensor-parallel rank, in memory its peer GPUs can read.

A Plan with `allreduce` ops over G > 1 ranks runs as one megakernel per GPU (one process per
rank, torch.distributed initialised: mpk.parallel.launch). Its all-reduce tasks read the peers'
partial products straight from the peers' arenas and publish / poll cross-GPU flags, so the
arena is allocated as torch symmetric memory (torch.distributed._symmetric_memory: every
rank's buffer mapped into every process, no NVLink multicast) with the flags after the
activations:

    [0, arena_bytes)                 activations, at the Plan's offsets (the same on every rank)
    [xflags_offset, + 8 * T * G)     u64 flags[task][source rank], zero at start, monotonic

Every rank compiles the same Plan, so a tensor's offset, and a task's flag slot, are the same
in every arena; the kernel gets every rank's arena base (Params::peer_arenas).
NOT RUN ON GPUs YET: no machine with several GPUs was available when this was written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpk import env
from mpk.compiler.plan import Plan
from mpk.errors import MpkError, UnsupportedError

FLAG_ALIGN = 256


@dataclass(frozen=True)
class PeerArena:
    arena: torch.Tensor  # this rank's activations: uint8 [arena_bytes], a view of `buffer`
    buffer: torch.Tensor  # the whole symmetric allocation (activations + flags)
    bases: torch.Tensor  # int64 [ranks] on the device: every rank's buffer as mapped here
    xflags_offset: int
    rank: int
    ranks: int
    handle: object  # the rendezvous handle: keeps the peers' mappings alive


def plan_ranks(plan: Plan) -> int:
    """How many tensor-parallel ranks the Plan's all-reduces sum (1: none)."""
    ranks = {int(dict(op.attrs)["ranks"]) for op in plan.ops if op.kind == "allreduce"}
    if len(ranks) > 1:
        raise MpkError(f"the plan's all-reduces disagree on the rank count: {sorted(ranks)}")
    return ranks.pop() if ranks else 1


def allocate(plan: Plan, device: torch.device, poison: bool) -> PeerArena:
    """Collective over the default process group: every rank must call it, in the same order."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    ranks = plan_ranks(plan)
    if not dist.is_initialized() or dist.get_world_size() != ranks:
        have = dist.get_world_size() if dist.is_initialized() else "no"
        raise UnsupportedError(f"the plan is one rank of {ranks}-way tensor parallelism; run it "
                               f"in a torch.distributed group of {ranks} processes, one per GPU "
                               f"(mpk.parallel.launch.run_ranks), not with {have} group")
    env.disable_multicast()  # before the rendezvous, which would otherwise map multicast
    group_name = dist.group.WORLD.group_name  # a name works with every torch release
    xflags_offset = -(-max(plan.arena_bytes, 1) // FLAG_ALIGN) * FLAG_ALIGN
    flag_bytes = 8 * plan.num_tasks * ranks
    buffer = symm_mem.empty(xflags_offset + flag_bytes, dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buffer, group_name)
    mine = handle.buffer_ptrs[handle.rank]
    offset = buffer.data_ptr() - mine  # the tensor may start inside the mapped allocation
    bases = torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64,
                         device=device)
    buffer[:xflags_offset].fill_(0xFF if poison else 0)
    buffer[xflags_offset:].zero_()
    # No peer may publish a flag into this arena before it is zeroed.
    torch.cuda.synchronize(device)
    dist.barrier()
    return PeerArena(arena=buffer[:max(plan.arena_bytes, 1)], buffer=buffer, bases=bases,
                     xflags_offset=xflags_offset, rank=int(handle.rank),
                     ranks=int(handle.world_size), handle=handle)
