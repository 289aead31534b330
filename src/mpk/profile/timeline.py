"""Raw profiling stamps + the Plan -> one event per executed record.

The profiling build writes stamps[step][sm][index][stamp] (int64 %globaltimer ns; stamp
indices codegen.PROFILE_STAMPS) for every record a CTA runs:
  WAIT     the consumer warps are free for the record (they finished the previous one),
  READY    the controller saw the record's counter waits met,
  RUN      the consumers saw it ready: the task starts,
  INPUT    a kind's first mark (linear: its input staged and normalised; else = RUN),
  COMPUTE  a kind's second mark (linear: warp 0's weight walk of the last block; else = DONE),
  DONE     every consumer warp left the task,
  END      the storer fenced and issued its signals.
So wait_ns = RUN - WAIT is time the SM's compute spends on dependency counters (the controller
fetched the record and waited ahead, so this is only what that could not hide), and
run_ns = END - RUN is the task itself: weight pages (streamed ahead by the loader), activation
loads and compute, plus the fence and signal. Times are relative to the launch's first stamp;
%globaltimer is one clock for all SMs, so SMs line up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mpk.backends.cuda.codegen import PROFILE_STAMPS
from mpk.compiler import record
from mpk.compiler.plan import Plan
from mpk.errors import MpkError

WAIT, RUN, END = PROFILE_STAMPS["WAIT"], PROFILE_STAMPS["RUN"], PROFILE_STAMPS["END"]
READY, INPUT, COMPUTE, DONE = (PROFILE_STAMPS[name] for name in
                               ("READY", "INPUT", "COMPUTE", "DONE"))
NUM_STAMPS = len(PROFILE_STAMPS)
_COLUMNS = ("sm", "step", "index", "task", "kind_id", "op", "point", "start_ns", "ready_ns",
            "end_ns", "seen_ns", "input_ns", "compute_ns", "done_ns")


@dataclass(frozen=True)
class TaskEvent:
    """One record executed once: where, what, and its two phases (ns from the launch start)."""

    sm: int
    step: int  # local step in the launch
    global_step: int
    index: int  # position in its SM's list
    task: int
    kind: str
    op: str  # op (layer) name
    point: tuple[int, int, int]  # grid point
    start_ns: int  # WAIT stamp
    wait_ns: int  # RUN - WAIT
    run_ns: int  # END - RUN
    end_ns: int  # END stamp

    @property
    def name(self) -> str:
        return f"{self.op}{list(self.point)}"


@dataclass
class Timeline:
    """Every executed record of one launch as columns (numpy arrays of equal length)."""

    plan: Plan
    step_begin: int
    num_steps: int
    origin_ns: int  # absolute %globaltimer of the launch's first stamp (= time 0 here)
    missing: int  # records of the plan x steps that have no stamps (a stopped launch)
    sm: np.ndarray
    step: np.ndarray
    index: np.ndarray
    task: np.ndarray
    kind_id: np.ndarray
    op: np.ndarray
    point: np.ndarray  # [n, 3]
    start_ns: np.ndarray
    ready_ns: np.ndarray  # RUN stamp
    end_ns: np.ndarray
    seen_ns: np.ndarray  # READY stamp: the controller saw the waits met
    input_ns: np.ndarray  # INPUT mark (RUN where the kind does not mark)
    compute_ns: np.ndarray  # COMPUTE mark (DONE where the kind does not mark)
    done_ns: np.ndarray  # DONE stamp

    def __len__(self) -> int:
        return len(self.task)

    @property
    def wait_ns(self) -> np.ndarray:
        return self.ready_ns - self.start_ns

    @property
    def run_ns(self) -> np.ndarray:
        return self.end_ns - self.ready_ns

    @property
    def span_ns(self) -> int:
        """From the launch's first stamp to its last."""
        return int(self.end_ns.max()) if len(self) else 0

    @property
    def ns_per_step(self) -> float:
        return self.span_ns / max(self.num_steps, 1)

    def kind_names(self) -> np.ndarray:
        """The kind name of every event (object array)."""
        return np.asarray(self.plan.kinds, dtype=object)[self.kind_id]

    def op_names(self) -> np.ndarray:
        """The op (layer) name of every event (object array)."""
        return np.asarray([o.name for o in self.plan.ops], dtype=object)[self.op]

    def events(self) -> list[TaskEvent]:
        kinds, ops = self.plan.kinds, [o.name for o in self.plan.ops]
        wait, run = self.wait_ns, self.run_ns
        return [TaskEvent(int(self.sm[e]), int(self.step[e]), self.step_begin + int(self.step[e]),
                          int(self.index[e]), int(self.task[e]), kinds[self.kind_id[e]],
                          ops[self.op[e]], tuple(int(x) for x in self.point[e]),
                          int(self.start_ns[e]), int(wait[e]), int(run[e]), int(self.end_ns[e]))
                for e in range(len(self))]

    def step_spans(self) -> np.ndarray:
        """[num_steps, 2]: the first WAIT and the last END stamp of each local step (ns).
        Steps overlap a little: an SM starts step s+1 while others finish step s."""
        spans = np.zeros((self.num_steps, 2), dtype=np.int64)
        for s in range(self.num_steps):
            sel = self.step == s
            if sel.any():
                spans[s] = (self.start_ns[sel].min(), self.end_ns[sel].max())
        return spans

    def first_steps(self, count: int) -> Timeline:
        """The events of local steps 0 .. count-1 only (same time origin): a readable window
        for the trace and the picture when the launch has thousands of tasks per step."""
        if count >= self.num_steps:
            return self
        sel = self.step < count
        columns = {name: getattr(self, name)[sel] for name in _COLUMNS}
        return replace(self, num_steps=max(count, 0), **columns)

    def timer_resolution_ns(self) -> int | None:
        """The smallest step between distinct stamps: %globaltimer's update granularity when
        there are enough stamps (it is coarse on some GPUs/drivers; then short tasks read 0)."""
        gaps = np.diff(np.sort(np.concatenate([self.start_ns, self.ready_ns, self.end_ns])))
        gaps = gaps[gaps > 0]
        return int(gaps.min()) if len(gaps) else None


def from_stamps(stamps: np.ndarray, plan: Plan, step_begin: int = 0) -> Timeline:
    """Turn stamps [steps, num_sms, max_len, NUM_STAMPS] (int64 or uint64 ns; zero = not executed) of a
    launch of `plan` that began at global step `step_begin` into a Timeline."""
    stamps = np.asarray(stamps)
    instrs = plan.instrs.reshape(plan.num_sms, -1, record.WORDS)
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    if (stamps.ndim != 4 or stamps.shape[1] != plan.num_sms or stamps.shape[3] != NUM_STAMPS
            or stamps.shape[2] < int(lengths.max(initial=0))):
        raise MpkError(f"profile stamps of shape {stamps.shape} do not fit the plan: expected "
                       f"[steps, {plan.num_sms}, >= {int(lengths.max(initial=0))}, {NUM_STAMPS}]")
    stamps = stamps.astype(np.int64)  # %globaltimer stays far below 2**63
    num_steps, max_len = stamps.shape[0], stamps.shape[2]
    planned = np.arange(max_len)[None, None, :] < lengths[None, :, None]  # [1, sms, max_len]
    planned = np.broadcast_to(planned, stamps.shape[:3])
    # The marks are optional (zero where a kind does not mark); the other stamps are not.
    ran = planned & (np.delete(stamps, [INPUT, COMPUTE], axis=3) > 0).all(axis=3)
    if not ran.any():
        raise MpkError("the profile holds no stamps: was the executor built with profile=True, "
                       "and did the launch run?")
    step, sm, index = np.nonzero(ran)
    raw = stamps[step, sm, index]  # [n, NUM_STAMPS]
    origin = int(raw[:, WAIT].min())
    recs = instrs[sm, index]
    run, done = raw[:, RUN], raw[:, DONE]
    mark_in = np.where(raw[:, INPUT] > 0, raw[:, INPUT], run)
    mark_compute = np.where(raw[:, COMPUTE] > 0, raw[:, COMPUTE], done)
    return Timeline(
        plan=plan, step_begin=int(step_begin), num_steps=int(num_steps), origin_ns=origin,
        missing=int((planned & ~ran).sum()), sm=sm.astype(np.int64),
        step=step.astype(np.int64), index=index.astype(np.int64),
        task=recs[:, record.TASK].astype(np.int64), kind_id=recs[:, record.KIND].astype(np.int64),
        op=recs[:, record.OP].astype(np.int64),
        point=recs[:, record.POINT:record.POINT + 3].astype(np.int64),
        start_ns=raw[:, WAIT] - origin, ready_ns=run - origin, end_ns=raw[:, END] - origin,
        seen_ns=raw[:, READY] - origin, input_ns=mark_in - origin,
        compute_ns=mark_compute - origin, done_ns=done - origin)
