"""ctypes binding of a built megakernel library (see csrc/launch.cuh for the C side)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

from mpk.compiler import record
from mpk.errors import CompileError, MpkError

from . import codegen


class Params(ctypes.Structure):
    """Mirror of mpk::Params in csrc/params.cuh (checked against sizeof at load)."""

    _fields_ = [
        ("instrs", ctypes.c_void_p),
        ("lengths", ctypes.c_void_p),
        ("op_params", ctypes.c_void_p),
        ("tensors", ctypes.c_void_p),
        ("counters", ctypes.c_void_p),
        ("error", ctypes.c_void_p),
        ("abort_flag", ctypes.c_void_p),
        ("sm_state", ctypes.c_void_p),
        ("step_begin", ctypes.c_longlong),
        ("num_steps", ctypes.c_int),
        ("max_len", ctypes.c_int),
        ("timeout_ns", ctypes.c_longlong),
        ("profile", ctypes.c_void_p),  # profiling builds only; null otherwise
        ("peer_arenas", ctypes.c_void_p),  # tensor parallelism only; null otherwise
        ("xflags_offset", ctypes.c_longlong),
        ("rank", ctypes.c_int),
        ("ranks", ctypes.c_int),
    ]


@dataclass(frozen=True)
class KernelInfo:
    """What the driver reports for the loaded megakernel."""

    blocks_per_sm: int
    registers: int
    local_bytes: int
    static_smem: int


class Megakernel:
    """A loaded megakernel library with typed entry points."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._lib = ctypes.CDLL(str(self.path), mode=ctypes.RTLD_LOCAL)
        except OSError as e:
            raise CompileError(f"cannot load megakernel library {self.path}: {e}") from e
        lib = self._lib
        lib.mpk_launch.argtypes = [ctypes.POINTER(Params), ctypes.c_int, ctypes.c_int,
                                   ctypes.c_void_p]
        lib.mpk_launch.restype = ctypes.c_int
        lib.mpk_kernel_info.argtypes = [ctypes.c_int] + [ctypes.POINTER(ctypes.c_int)] * 4
        lib.mpk_kernel_info.restype = ctypes.c_int
        lib.mpk_error_string.argtypes = [ctypes.c_int]
        lib.mpk_error_string.restype = ctypes.c_char_p
        lib.mpk_kind_name.argtypes = [ctypes.c_int]
        lib.mpk_kind_name.restype = ctypes.c_char_p
        for name in ("mpk_abi_version", "mpk_record_words", "mpk_params_bytes", "mpk_error_words",
                     "mpk_num_kinds"):
            getattr(lib, name).argtypes = []
            getattr(lib, name).restype = ctypes.c_int
        self._check_abi()
        # After the ABI check: a stale (ABI 1) library lacks it and must fail with that message.
        lib.mpk_profile_enabled.argtypes = []
        lib.mpk_profile_enabled.restype = ctypes.c_int

    def _check_abi(self) -> None:
        expected = {
            "mpk_abi_version": codegen.ABI_VERSION,
            "mpk_record_words": record.WORDS,
            "mpk_params_bytes": ctypes.sizeof(Params),
            "mpk_error_words": codegen.ERROR_WORDS,
        }
        for name, want in expected.items():
            got = getattr(self._lib, name)()
            if got != want:
                raise CompileError(f"megakernel library {self.path} does not match this MPK: "
                                   f"{name}() = {got}, expected {want}; delete it to rebuild")

    # ---- entry points ---------------------------------------------------------------------
    def launch(self, params: Params, num_sms: int, device: int, stream: int) -> int:
        """Enqueue the megakernel; returns the cudaError_t (0 = success)."""
        return int(self._lib.mpk_launch(ctypes.byref(params), num_sms, device,
                                        ctypes.c_void_p(stream)))

    def kernel_info(self, device: int) -> KernelInfo:
        vals = [ctypes.c_int(0) for _ in range(4)]
        rc = self._lib.mpk_kernel_info(device, *(ctypes.byref(v) for v in vals))
        if rc != 0:
            raise MpkError(f"querying the megakernel failed: {self.error_string(rc)}")
        return KernelInfo(*(v.value for v in vals))

    def error_string(self, code: int) -> str:
        s = self._lib.mpk_error_string(code)
        return f"{s.decode() if s else 'unknown CUDA error'} (cudaError {code})"

    def kind_names(self) -> list[str]:
        return [self._lib.mpk_kind_name(i).decode() for i in range(self._lib.mpk_num_kinds())]

    @property
    def profiling(self) -> bool:
        """True for a build with MPK_PROFILE (it writes Params.profile)."""
        return bool(self._lib.mpk_profile_enabled())
