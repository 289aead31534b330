"""Start one process per tensor-parallel rank, run a function in each, return rank 0's result.

`run_ranks(G, fn, *args)` is what `mpk generate --tp G` uses: the processes are spawned (not
forked: CUDA cannot be forked), join a torch.distributed group over localhost (gloo for the CPU
interpreter, nccl for GPUs, one GPU per rank), run `fn(TensorParallel(rank, G), *args)` and send
rank 0's return value back. NVLink multicast is switched off before anything starts
(mpk.env.disable_multicast). If any rank fails, the others are stopped and the error names the
rank and its exception, so a broken rank never leaves its peers waiting forever.
"""

from __future__ import annotations

import socket
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from mpk import env
from mpk.backends.registry import get_backend
from mpk.errors import MpkError
from mpk.parallel.tp import TensorParallel

T = TypeVar("T")
POLL_S = 1.0
FAILURE_GRACE_S = 3.0
# How long a collective may wait for a peer before torch gives up: ranks wait at their first
# launch's barrier while rank 0 of `mpk bench --tp` compiles the torch.compile baseline.
GROUP_TIMEOUT_S = 900


class RankFailedError(MpkError):
    """A tensor-parallel rank raised or died; the message names the rank and the cause."""


def run_ranks(size: int, fn: Callable[..., T], *args: Any, backend: str = "cpu") -> T:
    """fn(TensorParallel(rank, size), *args) in `size` processes; rank 0's return value.

    `fn` and `args` must be picklable (a module-level function, plain data). size 1 runs in
    this process without a group."""
    tp = TensorParallel(0, size)  # validates size
    if size == 1:
        return fn(tp, *args)
    on_gpus = get_backend(backend).device_type == "cuda"
    if on_gpus and torch.cuda.device_count() < size:
        raise MpkError(f"tensor parallel size {size} needs {size} GPUs, but torch sees "
                       f"{torch.cuda.device_count()}")
    env.disable_multicast()
    ctx = mp.get_context("spawn")
    port = _free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(size)]  # (parent's end, rank's end)
    procs = [ctx.Process(target=_rank_main, args=(rank, size, port, on_gpus, fn, args, send),
                         daemon=True) for rank, (_, send) in enumerate(pipes)]
    for p in procs:
        p.start()
    for _, send in pipes:
        send.close()  # the rank holds its own copy; EOF then means the rank is gone
    try:
        return _collect(procs, [recv for recv, _ in pipes])
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=10)
        for recv, _ in pipes:
            recv.close()


def _collect(procs: list[Any], pipes: list[Connection]) -> Any:
    """Wait for every rank's report; rank 0's value. After the first failure the other ranks
    get FAILURE_GRACE_S to report too (a peer of a crashed rank usually fails on its broken
    connection), and the error lists every failure, ranks that died first: the root cause."""
    pending = dict(enumerate(pipes))
    value = None
    failures: dict[int, tuple[bool, str]] = {}  # rank -> (died, message)
    deadline = None
    while pending and (deadline is None or time.monotonic() < deadline):
        for conn in wait(list(pending.values()), timeout=POLL_S):
            rank = pipes.index(conn)  # type: ignore[arg-type]
            del pending[rank]
            try:
                ok, payload = conn.recv()
            except EOFError:
                procs[rank].join(timeout=10)  # the pipe closes just before the exit code is set
                code = procs[rank].exitcode
                failures[rank] = (True, f"rank {rank} exited with code {code} before a result")
                continue
            if not ok:
                failures[rank] = (False, f"rank {rank} failed: {payload}")
            elif rank == 0:
                value = payload
        if failures and deadline is None:
            deadline = time.monotonic() + FAILURE_GRACE_S
    if failures:
        ordered = sorted(failures.items(), key=lambda item: (not item[1][0], item[0]))
        raise RankFailedError("tensor-parallel " + "; ".join(msg for _, (_, msg) in ordered))
    return value


def _rank_main(rank: int, size: int, port: int, on_gpus: bool, fn: Callable[..., Any],
               args: tuple[Any, ...], report: Connection) -> None:
    """Body of one rank's process. The result (or the failure) is reported before the group
    is torn down, so a rank stuck on a dead peer cannot hide the cause."""
    # tqdm guards its bars with a multiprocessing lock that a spawned process never frees (the
    # parent then warns of a leaked semaphore at exit); one rank's bars need only a thread lock.
    tqdm.set_lock(threading.RLock())
    try:
        if on_gpus:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if on_gpus else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        value = fn(TensorParallel(rank, size), *args)
        report.send((True, value if rank == 0 else None))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        report.send((False, last))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
