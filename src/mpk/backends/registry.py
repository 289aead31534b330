"""The backends MPK has: each one's name, the device it runs on, and how many SMs it plans for.

Everything above the backends (engine, check, bench, CLI, server) asks this module instead of
comparing backend names itself, so adding a backend is one entry here plus its executor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpk.compiler.plan import Plan
from mpk.errors import MpkError, UnsupportedError
from mpk.graph.graph import DEFAULT_NUM_SMS
from mpk.backends.base import Executor

# The CPU interpreter's default: every output row is computed inside one task whatever the
# partition, so fewer, larger tasks give the same tokens (measured on SmolLM2-135M: logits
# bitwise equal at 1, 4 and 132 SMs) about 7x faster than 132 SMs' worth of tiles.
CPU_NUM_SMS = 4


@dataclass(frozen=True)
class Backend:
    """One backend: its name, the torch device type its tensors live on, a one-line summary."""

    name: str
    device_type: str
    summary: str

    def device(self, device: str | torch.device | None = None) -> torch.device:
        """The device this backend runs on (default: its natural one), or a clear error."""
        chosen = torch.device(device or self.device_type)
        if self.device_type == "cuda" and not torch.cuda.is_available():
            raise UnsupportedError("backend 'cuda' needs a CUDA GPU, but torch sees none "
                                   "(torch.cuda.is_available() is False); use backend 'cpu'")
        if chosen.type != self.device_type:
            raise MpkError(f"backend {self.name!r} runs on a {self.device_type} device, "
                           f"not {chosen}")
        return chosen

    def num_sms(self, device: str | torch.device | None = None) -> int:
        """The SM count to plan for: the GPU's own (one persistent CTA per SM, so a plan for
        more SMs than the GPU has cannot launch), the interpreter's default, or, with no GPU
        attached, the default target DEFAULT_NUM_SMS."""
        if self.device_type == "cpu":
            return CPU_NUM_SMS
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(
                torch.device(device or "cuda")).multi_processor_count
        return DEFAULT_NUM_SMS

    def executor(self, plan: Plan, device: str | torch.device | None = None,
                 **options: object) -> Executor:
        """This backend's executor for `plan` on `device` (the interpreter runs on the CPU)."""
        if self.name == "cpu":
            from mpk.backends.cpu.interpreter import CpuExecutor

            self.device(device)
            return CpuExecutor(plan, **options)  # type: ignore[arg-type]
        from mpk.backends.cuda.executor import CudaExecutor

        if device is not None:
            options["device"] = device
        return CudaExecutor(plan, **options)  # type: ignore[arg-type]


BACKENDS: dict[str, Backend] = {
    "cpu": Backend("cpu", "cpu", "the torch interpreter (reference semantics, any machine)"),
    "cuda": Backend("cuda", "cuda", "the persistent megakernel (sm_90a: H100 / H200)"),
}
BACKEND_NAMES = tuple(BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend called `name`, or a clear error listing the ones there are."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise UnsupportedError(f"unknown backend {name!r}: use one of {BACKEND_NAMES}") from None


def create_executor(plan: Plan, backend: str, device: str | torch.device | None = None,
                    **options: object) -> Executor:
    """The executor of `backend` for `plan` (on `device`, default the backend's own)."""
    return get_backend(backend).executor(plan, device, **options)
