"""The instruction record: one fixed-size row of int32 words per task, read by every backend.

This table is the single source of the layout: the CUDA code generator emits these constants
into the megakernel source, and the CPU interpreter decodes records with them.
"""

from __future__ import annotations

WORDS = 80
MAX_WAITS = 4
MAX_SIGNALS = 2
MAX_OPERANDS = 10
MAX_PREFETCH = 2
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
PREFETCH = 54  # MAX_PREFETCH x (tensor id or -1, byte offset low, byte offset high, bytes)
END = 62

WAIT_STRIDE = 3
OPERAND_STRIDE = 3
PREFETCH_STRIDE = 4

assert WAITS + MAX_WAITS * WAIT_STRIDE <= NUM_SIGNALS
assert OPERANDS + MAX_OPERANDS * OPERAND_STRIDE <= PREFETCH
assert PREFETCH + MAX_PREFETCH * PREFETCH_STRIDE <= END <= WORDS


def layout_constants() -> dict[str, int]:
    """Every layout constant by name, for code generation and ABI checks."""
    return {k: v for k, v in globals().items() if k.isupper() and isinstance(v, int)}


def split64(value: int) -> tuple[int, int]:
    """A non-negative 64-bit value as (low, high) signed int32 words."""
    lo = value & 0xFFFFFFFF
    hi = (value >> 32) & 0xFFFFFFFF
    return _signed(lo), _signed(hi)


def join64(lo: int, hi: int) -> int:
    return (int(lo) & 0xFFFFFFFF) | ((int(hi) & 0xFFFFFFFF) << 32)


def _signed(word: int) -> int:
    return word - (1 << 32) if word >= (1 << 31) else word
