"""The element types a Plan may use, their torch dtypes and sizes."""

from __future__ import annotations

import enum

import torch


class DType(enum.Enum):
    BF16 = "bf16"
    F32 = "f32"
    I32 = "i32"

    @property
    def torch(self) -> torch.dtype:
        return _TORCH[self]

    @property
    def itemsize(self) -> int:
        return 4 if self in (DType.F32, DType.I32) else 2

    @property
    def is_float(self) -> bool:
        return self is not DType.I32

    @staticmethod
    def of(dtype: torch.dtype) -> DType:
        for key, value in _TORCH.items():
            if value == dtype:
                return key
        raise ValueError(f"unsupported torch dtype {dtype}; MPK tensors are bf16, f32 or i32")


_TORCH = {DType.BF16: torch.bfloat16, DType.F32: torch.float32, DType.I32: torch.int32}
