"""Compiled plans cached by content: a second start of the same model compiles nothing.

The key hashes the graph (tensors and ops, with every attribute), the SM count, the fusion flag
and the source of everything that shapes a Plan (the compiler, the graph, the task kinds'
Python side). A hit loads plan.json + plan.npz from env.cache_dir()/plans/<key>/; a miss
compiles and stores the plan atomically (a temporary folder renamed into place), so a crashed
or concurrent writer never leaves a half-written plan behind. An unreadable cache entry is
recompiled, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import zipfile
from functools import cache
from pathlib import Path

from mpk import env
from mpk.compiler.lower import compile_graph
from mpk.compiler.plan import Plan
from mpk.graph.graph import DEFAULT_NUM_SMS, Graph

log = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parents[1]  # src/mpk
_SOURCES = ("compiler", "graph", "tasks", "tensors.py", "dtypes.py")


@cache
def _source_digest() -> str:
    h = hashlib.sha256()
    for entry in _SOURCES:
        path = _PACKAGE / entry
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for f in files:
            h.update(str(f.relative_to(_PACKAGE)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def graph_key(graph: Graph, num_sms: int, fuse_ops: bool = True) -> str:
    """The content key of compiling `graph` for `num_sms` SMs."""
    desc = {
        "tensors": [[t.name, list(t.shape), t.dtype.value, t.role.value]
                    for t in graph.tensors.values()],
        "ops": [[op.kind, op.name, list(op.grid), [list(o) for o in op.operands],
                 [[name, list(split)] for name, split in op.splits],
                 [[k, v] for k, v in op.attrs]] for op in graph.ops],
        "num_sms": num_sms, "fuse": fuse_ops, "source": _source_digest(),
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()[:24]


def compile_cached(graph: Graph, num_sms: int = DEFAULT_NUM_SMS, *, fuse_ops: bool = True,
                   cache_root: Path | None = None) -> Plan:
    """compile_graph, or the stored plan of an identical earlier compile."""
    t0 = time.perf_counter()
    key = graph_key(graph, num_sms, fuse_ops)
    root = (cache_root or env.cache_dir()) / "plans"
    folder = root / key
    if (folder / "plan.npz").exists():
        try:
            plan = Plan.load(folder)
            plan.meta["cache"] = "hit"
            plan.meta["load_s"] = round(time.perf_counter() - t0, 3)
            return plan
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            log.warning("ignoring unreadable cached plan %s: %s", folder, e)
    plan = compile_graph(graph, num_sms, fuse_ops=fuse_ops)
    plan.meta["cache"] = "miss"
    _store(plan, root, folder)
    return plan


def _store(plan: Plan, root: Path, folder: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
        plan.save(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process stored it first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # a read-only or full cache costs a recompile next time, nothing more
        log.warning("could not store the compiled plan in %s: %s", root, e)
