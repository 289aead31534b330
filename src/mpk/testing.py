"""Helpers that only the tests use: token oracles, the multi-rank CPU executor, stream order.

Nothing in mpk's commands imports this module; it lives in the package (not in tests/) because
the GPU tests and the CPU tests share it, and its executor drives the interpreter's internals.

Token oracles: generated tokens against the reference model, teacher-forced, up to a near-tie.

MultiRankCpuExecutor: G tensor-parallel ranks on the CPU interpreter, with a simulated all-reduce.

Each rank is a plain CpuExecutor over its own Plan (its own tensors, poisoned activations and
dependency counters); this class only decides WHICH rank's task runs next and hands `allreduce`
tasks the peers' partials. The one rule it adds to the per-rank counters is the cross-rank wait
a real multi-GPU megakernel needs:

    an allreduce task of global step g (on any rank) runs only after, on EVERY rank, each task
    that writes the part of `partial` it reads has completed its step-g instance.

That is exactly what a per-tile cross-GPU counter with a `>= (g + 1) * count` wait would enforce.
The reverse hazard (a rank overwriting its partial with step g+1 before a slower peer has read
step g) needs no wait: a rank's next write to a partial buffer depends, through the hidden state,
on an all-reduce that needs every peer past its read (docs/tensor-parallel.md); the simulator
CHECKS that claim on every all-reduce it runs and raises CrossRankHazardError if it is violated.

Orders: "schedule" always advances the lowest (rank, SM) that can run, so rank 0 races as far
ahead of its peers as the waits allow (the adversarial case for a missing wait); "random" picks
a random runnable (rank, SM) each time (seeded).

StreamOrdered: an executor as a CUDA stream orders it, for tests of host code that overlaps
launches (the scheduler starts a launch before the last one's tokens are read).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mpk.backends.cpu.interpreter import CpuExecutor
from mpk.compiler import record
from mpk.compiler.plan import Plan
from mpk.dtypes import DType
from mpk.errors import MpkError
from mpk.graph.graph import Graph
from mpk.models import decode_io as io
from mpk.models.reference import ReferenceModel
from mpk.parallel.group import REDUCE_KIND
from mpk.parallel.tp import TensorParallel, shard_dim, unshard
from mpk.tasks.base import grid_points
from mpk.tasks.registry import get_kind
from mpk.tensors import Role

# Two logits closer than this (in units of the logits' std) are a near-tie: bf16 rounding and
# summation order may legitimately pick either, so greedy tokens are compared up to it.
NEAR_TIE = 2e-2


# ---- token oracles ---------------------------------------------------------------------------
def teacher_forced_gaps(ref: ReferenceModel, prompt: list[int],
                        tokens: list[int]) -> torch.Tensor:
    """For each generated token, how far its logit falls below the best one (in units of the
    logits' std) when the reference reads the same context: the prompt and the tokens before it.
    0 means the reference would have chosen it too."""
    seq = torch.tensor([prompt + tokens[:-1]])
    logits = ref.forward(seq, 0)[0, len(prompt) - 1:].double().cpu()
    chosen = logits.gather(1, torch.tensor(tokens)[:, None])
    best = logits.max(dim=1, keepdim=True).values
    return ((best - chosen) / logits.std(dim=1, keepdim=True)).squeeze(1)


def greedy_mismatches(ref: ReferenceModel, prompts: list[list[int]],
                      outputs: list[list[int]], near_tie: float = NEAR_TIE) -> list[str]:
    """The generated tokens that are not the reference's greedy choice up to a near-tie (in
    units of the logits' std), described for an assertion message; empty when all agree."""
    bad = []
    for row, (prompt, tokens) in enumerate(zip(prompts, outputs, strict=True)):
        gaps = teacher_forced_gaps(ref, prompt, tokens)
        bad += [f"prompt {row} step {i}: token {tokens[i]} is {float(g):.3g} std below the best"
                for i, g in enumerate(gaps) if g > near_tie]
    return bad


# ---- a CUDA stream's ordering on the host ---------------------------------------------------
class Stream:
    """The order of one CUDA stream: writes and launches queue and run when a launch's result
    is waited for (or a synchronous read needs them), each in the order it was issued."""

    def __init__(self) -> None:
        self._queue: list[Any] = []

    def issue(self, work: Any) -> None:
        self._queue.append(work)

    def sync_through(self, work: Any | None = None) -> None:
        """Run the queue up to and including `work` (None: all of it)."""
        while self._queue:
            done = self._queue.pop(0)
            done()
            if done is work:
                return


class _Queued:
    def __init__(self, stream: Stream, work: Any, results: dict[str, torch.Tensor]) -> None:
        self.stream, self.work, self.results = stream, work, results

    def wait(self) -> dict[str, torch.Tensor]:
        self.stream.sync_through(self.work)
        return self.results


class StreamOrdered:
    """`inner` (any executor) seen through `stream`: write() and start() return at once, their
    work runs in issue order when a launch is waited for, so a write made while a launch is in
    flight lands after it, and a launch's reads are what it left. read() and run() sync. Other
    attributes are inner's. Executors that share a KV cache share a stream, as on the GPU."""

    def __init__(self, inner: Any, stream: Stream | None = None) -> None:
        self.inner, self.stream = inner, stream or Stream()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def write(self, name: str, value: torch.Tensor) -> None:
        copy = value.clone()  # the host may reuse its buffer once write() returns
        self.stream.issue(lambda: self.inner.write(name, copy))

    def read(self, name: str) -> torch.Tensor:
        self.stream.sync_through()
        return self.inner.read(name)

    def run(self, num_steps: int = 1) -> None:
        self.start(num_steps).wait()

    def start(self, num_steps: int, reads: Sequence[str] = ()) -> _Queued:
        results: dict[str, torch.Tensor] = {}

        def launch() -> None:
            self.inner.run(num_steps)
            results.update({name: self.inner.read(name) for name in reads})

        self.stream.issue(launch)
        return _Queued(self.stream, launch, results)


# ---- a sampling head: lm_head with the argmax epilogue, then argmax_reduce ---------------------
def sampling_head_graph(batch: int, vocab: int, k: int, tasks: int, steps: int,
                        runs: bool = False) -> Graph:
    """x [batch, k] @ w [vocab, k]^T -> logits, the argmax epilogue over `tasks` slices with the
    SAMPLING and POSITIONS inputs (and RUNS with `runs`), and argmax_reduce (with the logits,
    for top-k / top-p rows) writing tokens_out [steps, batch]: the tail of a decode step,
    alone."""
    g = Graph()
    g.add_tensor("x", (batch, k), DType.BF16, Role.IO)
    g.add_tensor("w", (vocab, k), DType.BF16, Role.WEIGHT)
    g.add_tensor("logits", (batch, vocab), DType.F32, Role.ACTIVATION)
    g.add_tensor("pv", (batch, tasks), DType.F32, Role.ACTIVATION)
    g.add_tensor("pi", (batch, tasks), DType.I32, Role.ACTIVATION)
    g.add_tensor(io.SAMPLING, (batch, io.SAMPLING_WORDS), DType.I32, Role.IO)
    g.add_tensor(io.POSITIONS, (batch,), DType.I32, Role.IO)
    g.add_tensor("tokens", (batch,), DType.I32, Role.ACTIVATION)
    g.add_tensor("tokens_out", (steps, batch), DType.I32, Role.IO)
    heads = {"sampling": io.SAMPLING, "positions": io.POSITIONS}
    if runs:
        g.add_tensor(io.RUNS, (batch, io.RUN_WORDS), DType.I32, Role.IO)
        heads["runs"] = io.RUNS
    g.add_op("linear", "head", (tasks,), {"x": "x", "weight": "w", "out": "logits",
                                          "part_val": "pv", "part_idx": "pi", **heads},
             epilogue="argmax")
    g.add_op("argmax_reduce", "pick", (batch,), {"part_val": "pv", "part_idx": "pi",
                                                 "tokens": "tokens", "tokens_out": "tokens_out",
                                                 "logits": "logits", **heads})
    return g


# ---- tensor-parallel ranks in one process ----------------------------------------------------
ORDERS = ("schedule", "random")


class CrossRankHazardError(MpkError):
    """A rank overwrote a partial before a peer's all-reduce of the previous step read it."""


def _overlaps(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> bool:
    return all(lo_a < hi_b and lo_b < hi_a for (lo_a, hi_a), (lo_b, hi_b) in zip(a, b))


class MultiRankCpuExecutor:
    """Runs `plans[r]` as rank r of len(plans) tensor-parallel ranks, launch by launch.

    `cross_rank_wait=False` drops the simulated all-reduce wait (an allreduce then reads whatever
    its peers' partial buffers hold): only for tests that prove the wait is needed.
    """

    def __init__(self, plans: Sequence[Plan], order: str = "schedule", seed: int | None = None,
                 poison: bool = True, cross_rank_wait: bool = True) -> None:
        if order not in ORDERS:
            raise MpkError(f"unknown order {order!r}; use one of {ORDERS}")
        if not plans:
            raise MpkError("MultiRankCpuExecutor needs at least one plan")
        self.plans = list(plans)
        self.size = len(self.plans)
        self.order = order
        self.rng = random.Random(seed)
        self.cross_rank_wait = cross_rank_wait
        # The per-rank order is never used (this class schedules); each rank keeps its tensors,
        # counters and step number in its own CpuExecutor.
        self.ranks = [CpuExecutor(plan, poison=poison) for plan in self.plans]
        self._done = [np.zeros(plan.num_tasks, dtype=np.int64) for plan in self.plans]
        # rank -> allreduce task -> [(peer rank, peer's matching task, peer's producer tasks)]
        self._reduces: list[dict[int, list[tuple[int, int, list[int]]]]] = []
        self._producers: list[set[int]] = []  # rank -> tasks writing some allreduce's partial
        self._link_ranks()

    # ---- per-rank Executor operations --------------------------------------------------------
    def bind(self, rank: int, name: str, tensor: torch.Tensor) -> None:
        self._rank(rank).bind(name, tensor)

    def write(self, rank: int, name: str, value: torch.Tensor) -> None:
        self._rank(rank).write(name, value)

    def read(self, rank: int, name: str) -> torch.Tensor:
        return self._rank(rank).read(name)

    def as_executor(self) -> FullModelExecutor:
        """The G ranks seen as ONE executor of the unsharded model (the Executor protocol)."""
        return FullModelExecutor(self)

    def run(self, num_steps: int = 1) -> None:
        """Run global steps g .. g+num_steps-1 on every rank (one launch per GPU)."""
        for r, ex in enumerate(self.ranks):
            missing = [t.name for t in ex.plan.tensors if t.name not in ex.tensors]
            if missing:
                raise MpkError(f"rank {r}: bind these tensors before running: "
                               f"{', '.join(missing)}")
        if len({ex.step_begin for ex in self.ranks}) != 1:
            raise MpkError("ranks are at different steps; run them only through this executor")
        views = [ex._task_views() for ex in self.ranks]  # the interpreter's own tile views
        peers = self._peer_views(views)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as CpuExecutor.run: tiles are too small for intra-op threads
        try:
            self._run_steps(num_steps, views, peers)
        finally:
            torch.set_num_threads(threads)
        for ex in self.ranks:
            ex.step_begin += num_steps

    # ---- the interleaved schedule ------------------------------------------------------------
    def _run_steps(self, num_steps: int, views: list[dict], peers: list[dict]) -> None:
        lengths = [[int(x) for x in plan.lengths] for plan in self.plans]
        pos = [[0] * plan.num_sms for plan in self.plans]
        total = [[num_steps * n for n in row] for row in lengths]
        ready = [(r, sm) for r in range(self.size) for sm in range(self.plans[r].num_sms)
                 if total[r][sm]]
        blocked: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (rank, counter) -> SMs
        cross_blocked: list[tuple[int, int]] = []  # SMs whose next task waits on a peer rank
        while ready:
            k = self.rng.randrange(len(ready)) if self.order == "random" else 0
            r, sm = ready[k]
            ex = self.ranks[r]
            step, i = divmod(pos[r][sm], lengths[r][sm])
            rec = self.plans[r].instrs[sm, i]
            gstep = ex.step_begin + step
            missing = ex.counters.unmet(rec, gstep)
            if missing is not None:
                ready.pop(k)
                blocked.setdefault((r, missing), []).append((r, sm))
                continue
            task = int(rec[record.TASK])
            if self.cross_rank_wait and task in self._reduces[r] and \
                    not self._peers_done(r, task, gstep):
                ready.pop(k)
                cross_blocked.append((r, sm))
                continue
            self._execute(r, rec, step, views[r][task], peers[r].get(task))
            self._done[r][task] += 1
            for c in ex.counters.signal(rec):
                ready.extend(blocked.pop((r, c), []))
            if task in self._producers[r] and cross_blocked:
                ready.extend(cross_blocked)  # a partial appeared: re-check the waiting reduces
                cross_blocked.clear()
            pos[r][sm] += 1
            if pos[r][sm] == total[r][sm]:
                ready.remove((r, sm))
        stuck = [(r, sm) for r in range(self.size) for sm in range(len(pos[r]))
                 if pos[r][sm] < total[r][sm]]
        if stuck:
            raise RuntimeError(f"multi-rank interpreter stalled: (rank, SM) {stuck[:8]} can "
                               f"never advance")

    def _peers_done(self, r: int, task: int, gstep: int) -> bool:
        """Every rank's producers of this allreduce tile have run step gstep, and none later."""
        for q, _, producers in self._reduces[r][task]:
            for p in producers:
                done = int(self._done[q][p])
                if done < gstep + 1:
                    return False
                if done > gstep + 1:
                    raise CrossRankHazardError(
                        f"rank {q} ran {self.plans[q].task_name(p)} for step {done - 1} before "
                        f"rank {r}'s {self.plans[r].task_name(task)} read its step-{gstep} "
                        f"partial: the partial buffer needs a second copy (double buffering)")
        return True

    def _execute(self, r: int, rec: np.ndarray, step: int, views: dict[str, torch.Tensor],
                 peers: list[torch.Tensor] | None) -> None:
        extra: dict[str, Any] = {} if peers is None else {"peers": peers}
        self.ranks[r].execute(rec, step, views, extra)

    def _peer_views(self, views: list[dict]) -> list[dict[int, list[torch.Tensor]]]:
        """rank -> allreduce task -> the same tile of `partial` in every rank, in rank order."""
        return [{task: [views[q][peer]["partial"] for q, peer, _ in links]
                 for task, links in self._reduces[r].items()} for r in range(self.size)]

    # ---- set-up ------------------------------------------------------------------------------
    def _link_ranks(self) -> None:
        """Match every allreduce tile with its twin and the partial's producers on each rank."""
        names = [{op.name: i for i, op in enumerate(plan.ops) if op.kind == REDUCE_KIND}
                 for plan in self.plans]
        if any(set(n) != set(names[0]) for n in names):
            raise MpkError("the rank plans have different allreduce ops: compile every rank from "
                           "the same model, shape and tensor parallel size")
        for r, plan in enumerate(self.plans):
            reduces: dict[int, list[tuple[int, int, list[int]]]] = {}
            producers: set[int] = set()
            for name, index in names[r].items():
                op = plan.ops[index]
                ranks = dict(op.attrs)["ranks"]
                if ranks != self.size:
                    raise MpkError(f"rank {r}: allreduce {name!r} sums {ranks} ranks, but "
                                   f"{self.size} plans were given")
                for local, point in enumerate(grid_points(op.grid)):
                    links = []
                    for q, peer_plan in enumerate(self.plans):
                        peer_op = peer_plan.ops[names[q][name]]
                        if peer_op.grid != op.grid:
                            raise MpkError(f"allreduce {name!r}: grid {op.grid} on rank {r}, "
                                           f"{peer_op.grid} on rank {q}")
                        peer = peer_op.first_task + local
                        links.append((q, peer, _producers(peer_plan, names[q][name], point)))
                    reduces[op.first_task + local] = links
                producers.update(_producers(plan, index, None))
            self._reduces.append(reduces)
            self._producers.append(producers)

    def _rank(self, rank: int) -> CpuExecutor:
        if not 0 <= rank < self.size:
            raise MpkError(f"rank {rank} is outside [0, {self.size})")
        return self.ranks[rank]


def _producers(plan: Plan, reduce_op: int, point: tuple[int, int, int] | None) -> list[int]:
    """Tasks of `plan` that write the region of `partial` that allreduce task `point` of op
    `reduce_op` reads (point None: any region)."""
    view = plan.op_view(reduce_op)
    tensor = view.tensors["partial"].name
    want = None if point is None else get_kind(REDUCE_KIND).region(view, "partial", point)
    out = []
    for index, op in enumerate(plan.ops):
        kind = get_kind(op.kind)
        opview = plan.op_view(index)
        for operand, tid in op.operands:
            if plan.tensors[tid].name != tensor or not kind.operand(operand).access.writes:
                continue
            for local, p in enumerate(grid_points(op.grid)):
                if want is None or _overlaps(kind.region(opview, operand, p), want):
                    out.append(op.first_task + local)
    return out


class FullModelExecutor:
    """G ranks as one Executor of the full model: bind / write take FULL tensors and give each
    rank its shard (a copy: each GPU owns its memory); read gathers sharded tensors and, for
    everything else, insists that every rank holds the same bytes (logits, tokens: the
    replicated state must never diverge). Rank-local activations: use MultiRankCpuExecutor.read."""

    def __init__(self, ranks: MultiRankCpuExecutor) -> None:
        self.ranks = ranks
        self.plan = ranks.plans[0]  # tensor names and roles are the same on every rank
        self._tp = TensorParallel.all(ranks.size)

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        for tp in self._tp:
            self.ranks.bind(tp.rank, name, tp.shard(name, tensor).contiguous())

    def write(self, name: str, value: torch.Tensor) -> None:
        for tp in self._tp:
            self.ranks.write(tp.rank, name, tp.shard(name, value).contiguous())

    def read(self, name: str) -> torch.Tensor:
        parts = [self.ranks.read(tp.rank, name) for tp in self._tp]
        if shard_dim(name) is not None:
            return unshard(name, parts)
        first = _bytes(parts[0])
        for r, part in enumerate(parts[1:], start=1):
            if not torch.equal(first, _bytes(part)):
                raise MpkError(f"tensor {name!r} differs between rank 0 and rank {r}: it is "
                               f"rank-local (read it per rank) or the replicated state diverged")
        return parts[0]

    def run(self, num_steps: int = 1) -> None:
        self.ranks.run(num_steps)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t` (so NaN == NaN, -0.0 != 0.0: bit-identical means identical)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


# ---- mixture of experts ----------------------------------------------------------------------
import dataclasses  # (this section was appended; the imports above are shared)

from mpk.models.config import ModelConfig, get_preset


def moe_top3_config() -> ModelConfig:
    """The second tiny MoE test model (tiny-qwen3-moe is the first: 6 experts, top-2,
    renormalised, layer 1 dense): 10 experts, top-3 WITHOUT renormalisation, a 24-wide expert,
    layer 0 dense (mlp_only_layers)."""
    return dataclasses.replace(get_preset("tiny-qwen3-moe"), name="tiny-qwen3-moe-top3",
                               num_experts=10, num_experts_per_tok=3, norm_topk_prob=False,
                               moe_intermediate_size=24, mlp_only_layers=(0,))


def routing_margins(router_logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """For every routing decision (one per MoE layer and token, from transformers'
    `output_router_logits`), the gap between the last chosen expert's logit and the best
    unchosen one, in units of that row's logit std. A decision closer than the bf16 noise of
    two correct implementations may legitimately go either way (like a greedy near-tie)."""
    gaps = []
    for logits in router_logits:
        s = logits.float().sort(dim=-1, descending=True).values
        if top_k >= s.shape[-1]:
            gaps.append(torch.full((s.shape[0],), float("inf")))
        else:
            gaps.append((s[:, top_k - 1] - s[:, top_k]) / s.std(dim=-1))
    return torch.cat(gaps)


def cuda_constants(source: str) -> dict[str, int]:
    """The `constexpr int NAME = value;` definitions of CUDA source text."""
    return {m[0]: int(m[1]) for m in re.findall(r"constexpr int (\w+) = (-?\d+);", source)}
