"""The Plan: everything a backend needs to run a compiled graph, as plain data.

Instruction tables [num_sms, max_len, WORDS] (layout in record.py), the op parameter rows, the
tensor table (arena offsets for activations; attached tensors are bound at run time), and the
per-step count of each dependency counter. Serialised as JSON + .npz; `digest()` is stable and
keys the CUDA build cache.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mpk.compiler import record
from mpk.dtypes import DType
from mpk.errors import MpkError
from mpk.tasks.base import OpView
from mpk.tensors import Role, TensorSpec


@dataclass(frozen=True)
class PlanTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str  # DType value
    role: str  # Role value
    offset: int  # byte offset in the arena, -1 for attached tensors
    # Stored in the flagged form on the GPU (compiler/flags.py): u64 words [..., N/2] of a bf16
    # pair (or [..., N] of an int32) and its write's epoch, twice the bytes. Backends that do not
    # poll ignore it.
    flagged: bool = False

    @property
    def device_nbytes(self) -> int:
        """Bytes of the tensor's device storage (twice the data when flagged)."""
        n = DType(self.dtype).itemsize * int(np.prod(self.shape, dtype=np.int64))
        return 2 * n if self.flagged else n


@dataclass(frozen=True)
class PlanOp:
    name: str
    kind: str
    grid: tuple[int, int, int]
    operands: tuple[tuple[str, int], ...]  # (operand name, tensor id); absent optionals omitted
    splits: tuple[tuple[str, tuple[int | None, ...]], ...]
    attrs: tuple[tuple[str, Any], ...]
    first_task: int


@dataclass(frozen=True)
class PlanStream:
    """An op's GPU weight stream (TaskKind.stream_layout): built by the CUDA backend from the op's
    bound weights; the CPU interpreter never reads it. Its id in the device tensor table is
    len(Plan.tensors) + its index in Plan.streams."""

    op: int
    nbytes: int


@dataclass
class Plan:
    num_sms: int
    kinds: tuple[str, ...]
    tensors: tuple[PlanTensor, ...]
    ops: tuple[PlanOp, ...]
    op_params: np.ndarray  # int32 [num_ops, PARAM_WORDS]
    instrs: np.ndarray  # int32 [num_sms, max_len, WORDS]
    lengths: np.ndarray  # int32 [num_sms]
    # int32 [num_counters]: signals per counter per step (an arrival counter: its group's tasks,
    # which add all or none in a step)
    counter_counts: np.ndarray
    arena_bytes: int
    # Shared memory one task may use (the largest TaskKind.scratch_bytes of the plan, rounded up
    # to 16 KB so similar plans share a CUDA build); the rest holds weight pages.
    scratch_bytes: int = 16 * 1024
    streams: tuple[PlanStream, ...] = ()
    # Compile-time constants of the kinds' CUDA code (TaskKind.cuda_constants), largest per name
    constants: tuple[tuple[str, int], ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    def check_steps(self, num_steps: int) -> None:
        if num_steps < 1:
            raise MpkError(f"num_steps must be at least 1, got {num_steps}")

    # ---- lookups ---------------------------------------------------------------------------
    @property
    def num_tasks(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_counters(self) -> int:
        return int(len(self.counter_counts))

    def tensor_id(self, name: str) -> int:
        for i, t in enumerate(self.tensors):
            if t.name == name:
                return i
        raise KeyError(f"the plan has no tensor named {name!r}")

    def tensor(self, name: str) -> PlanTensor:
        return self.tensors[self.tensor_id(name)]

    def records(self) -> np.ndarray:
        """All task records in program order: int32 [num_tasks, WORDS]."""
        rows = [self.instrs[sm, : self.lengths[sm]] for sm in range(self.num_sms)]
        flat = np.concatenate(rows) if rows else np.zeros((0, record.WORDS), np.int32)
        return flat[np.argsort(flat[:, record.TASK], kind="stable")]

    def op_view(self, index: int) -> OpView:
        """The task kind's view of op `index` (shapes, splits, attrs), rebuilt from the Plan."""
        op = self.ops[index]
        tensors = {}
        for operand, tid in op.operands:
            t = self.tensors[tid]
            tensors[operand] = TensorSpec(t.name, tuple(t.shape), DType(t.dtype), Role(t.role))
        splits = {name: tuple(s) for name, s in op.splits}
        return OpView(op.name, op.kind, tuple(op.grid), tensors, splits, dict(op.attrs))

    def task_name(self, task: int) -> str:
        """A human name for a task id: layer name and grid point."""
        op = max((o for o in self.ops if o.first_task <= task), key=lambda o: o.first_task)
        rec = self.records()[task]
        point = tuple(int(x) for x in rec[record.POINT: record.POINT + 3])
        return f"{op.name}{list(point)}"

    def locate(self, task: int) -> tuple[int, int]:
        """(SM, index in its list) of a task."""
        for sm in range(self.num_sms):
            hits = np.nonzero(self.instrs[sm, : self.lengths[sm], record.TASK] == task)[0]
            if len(hits):
                return sm, int(hits[0])
        raise KeyError(task)

    # ---- serialisation ---------------------------------------------------------------------
    def header(self) -> dict[str, Any]:
        return {
            "format": 2,
            "num_sms": self.num_sms,
            "kinds": list(self.kinds),
            "tensors": [asdict(t) for t in self.tensors],
            "ops": [asdict(o) for o in self.ops],
            "arena_bytes": self.arena_bytes,
            "scratch_bytes": self.scratch_bytes,
            "streams": [asdict(s) for s in self.streams],
            "constants": [list(c) for c in self.constants],
            "record_words": record.WORDS,
        }

    def digest(self) -> str:
        h = hashlib.sha256(json.dumps(self.header(), sort_keys=True, default=str).encode())
        for arr in (self.op_params, self.instrs, self.lengths, self.counter_counts):
            h.update(np.ascontiguousarray(arr).tobytes())
        return h.hexdigest()[:20]

    def save(self, directory: str | Path) -> Path:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "plan.json").write_text(json.dumps({**self.header(), "meta": self.meta},
                                                indent=1, default=str))
        np.savez_compressed(d / "plan.npz", op_params=self.op_params, instrs=self.instrs,
                            lengths=self.lengths, counter_counts=self.counter_counts)
        return d

    @staticmethod
    def load(directory: str | Path) -> Plan:
        d = Path(directory)
        head = json.loads((d / "plan.json").read_text())
        arrays = np.load(d / "plan.npz")
        return Plan(
            num_sms=head["num_sms"],
            kinds=tuple(head["kinds"]),
            tensors=tuple(PlanTensor(t["name"], tuple(t["shape"]), t["dtype"], t["role"],
                                     t["offset"], t.get("flagged", False))
                          for t in head["tensors"]),
            ops=tuple(PlanOp(o["name"], o["kind"], tuple(o["grid"]),
                             tuple((a, b) for a, b in o["operands"]),
                             tuple((a, tuple(b)) for a, b in o["splits"]),
                             tuple((a, b) for a, b in o["attrs"]), o["first_task"])
                      for o in head["ops"]),
            op_params=arrays["op_params"], instrs=arrays["instrs"], lengths=arrays["lengths"],
            counter_counts=arrays["counter_counts"], arena_bytes=head["arena_bytes"],
            scratch_bytes=head.get("scratch_bytes", 16 * 1024),
            streams=tuple(PlanStream(s["op"], s["nbytes"]) for s in head.get("streams", [])),
            constants=tuple((str(n), int(v)) for n, v in head.get("constants", [])),
            meta=head.get("meta", {}),
        )
