"""The instruction record: one fixed-size row of int32 words per task, read by every backend.

This table is the single source of the layout: the CUDA code generator emits these constants
into the megakernel source, and the CPU interpreter decodes records with them.
"""

from __future__ import annotations

WORDS = 80
MAX_WAITS = 4
MAX_SIGNALS = 2
MAX_OPERANDS = 12
MAX_RUNS = 3
PARAM_WORDS = 32

KIND = 0  # index into Plan.kinds
OP = 1  # index into Plan.ops
TASK = 2  # global task id (program order)
NUM_WAITS = 3
WAITS = 4  # MAX_WAITS x (counter, count per step, previous step: 0/1)
NUM_SIGNALS = 16
SIGNALS = 17  # MAX_SIGNALS counter ids
POINT = 19  # grid point (3 words)
NUM_OPERANDS = 22
OPERANDS = 24  # MAX_OPERANDS x (tensor id or -1, element offset low, element offset high)
# The task's weight stream (TaskKind.stream_layout), which the runtime's loader copies into
# shared-memory pages ahead of the task: the stream tensor's id (-1: none), the byte offset of
# this task's part, and MAX_RUNS x (page count, bytes per page), unused runs (0, 0).
STREAM = 60
STREAM_OFFSET = 61  # low, high
STREAM_RUNS = 63
# Bit w set: the CUDA controller skips wait w, because the task polls the producers' data itself
# (flagged activations, compiler/flags.py). Every backend that does not poll honours the wait.
# Bit POLLS set: the task polls flagged data (skipped waits or not): the storer watches it.
POLLED = 69
POLLS = 1 << 8
END = 70

# The last FLAG_ENTRIES words of an op's parameter row belong to the compiler: one entry per
# flagged operand of the op (compiler/flags.py encodes them), zero when unused. A kind's own
# params take the words before them.
FLAG_ENTRIES = 4
FLAG_PARAMS = PARAM_WORDS - FLAG_ENTRIES
# The word before them is the compiler's too: the first of the op's arrival counters
# (TaskKind.arrivals; counters the tasks add to themselves), -1 when the op has none. A kind's
# own params take the KIND_PARAMS words before it.
ARRIVALS_PARAM = FLAG_PARAMS - 1
KIND_PARAMS = ARRIVALS_PARAM

WAIT_STRIDE = 3
OPERAND_STRIDE = 3
RUN_STRIDE = 2

assert WAITS + MAX_WAITS * WAIT_STRIDE <= NUM_SIGNALS
assert OPERANDS + MAX_OPERANDS * OPERAND_STRIDE <= STREAM
assert STREAM_RUNS + MAX_RUNS * RUN_STRIDE <= END <= WORDS


def layout_constants() -> dict[str, int]:
    """Every layout constant by name, for code generation and ABI checks."""
    return {k: v for k, v in globals().items() if k.isupper() and isinstance(v, int)}


def decode_waits(rec) -> list[tuple[int, int, int]]:
    """The (counter, count per step, previous step 0/1) waits of one record."""
    n = int(rec[NUM_WAITS])
    return [tuple(int(x) for x in rec[WAITS + WAIT_STRIDE * w: WAITS + WAIT_STRIDE * (w + 1)])
            for w in range(n)]  # type: ignore[misc]


def decode_signals(rec) -> list[int]:
    return [int(rec[SIGNALS + j]) for j in range(int(rec[NUM_SIGNALS]))]


def wait_target(count: int, prev: int, step: int) -> int:
    """The counter value a wait needs in global step `step` (counters are monotonic: each step
    adds `count`; a previous-step wait needs one step less)."""
    return (step + 1 - prev) * count


def split64(value: int) -> tuple[int, int]:
    """A non-negative 64-bit value as (low, high) signed int32 words."""
    lo = value & 0xFFFFFFFF
    hi = (value >> 32) & 0xFFFFFFFF
    return _signed(lo), _signed(hi)


def join64(lo: int, hi: int) -> int:
    return (int(lo) & 0xFFFFFFFF) | ((int(hi) & 0xFFFFFFFF) << 32)


def _signed(word: int) -> int:
    return word - (1 << 32) if word >= (1 << 31) else word
