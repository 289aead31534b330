"""Tensor descriptions in a Graph: a name, a shape, a dtype and who owns the memory."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from mpk.dtypes import DType
from mpk.errors import GraphError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


class Role(enum.Enum):
    """Who owns a tensor's memory.

    WEIGHT: attached by the user, read-only for the kernel.
    IO: attached by the user or the engine and may be read and written by the kernel
        (prompt tokens, positions, page tables, KV caches, generated tokens).
    ACTIVATION: scratch in the Plan's arena; the compiler places it, the interpreter poisons it.
    """

    WEIGHT = "weight"
    IO = "io"
    ACTIVATION = "activation"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: DType
    role: Role

    def __post_init__(self) -> None:
        check_name(self.name, "tensor")
        if not self.shape or any((not isinstance(d, int)) or d <= 0 for d in self.shape):
            raise GraphError(f"tensor '{self.name}': shape {self.shape} must be positive integers")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def strides(self) -> tuple[int, ...]:
        """Row-major element strides."""
        out = [1] * len(self.shape)
        for i in range(len(self.shape) - 2, -1, -1):
            out[i] = out[i + 1] * self.shape[i + 1]
        return tuple(out)


def check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise GraphError(
            f"invalid {what} name {name!r}: use letters, digits, '_', '.', '-' and start with a letter"
        )
