"""Helpers of the kernel tests: every task kind's sm_90a kernel against the CPU interpreter.

Each case is a one-op graph compiled with compile_graph and run by both executors on the same
random inputs (inputs are IO tensors bound to both; outputs are arena activations, poisoned on
both sides, so an element the kernel forgets to write shows up as NaN / poison). Integer outputs
and pure copies must match exactly; float outputs to ||gpu - cpu|| / ||cpu|| <= 1e-2.
"""

from __future__ import annotations

import torch

from mpk.backends.registry import create_executor
from mpk.compiler.lower import compile_graph
from mpk.dtypes import DType
from mpk.graph.graph import Graph

from mpk.tensors import Role

NUM_SMS = 16
RTOL = 1e-2
BF16, F32, I32 = DType.BF16, DType.F32, DType.I32


# ---- helpers ---------------------------------------------------------------------------------
def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype: torch.dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def rope_table(max_pos: int, d: int) -> torch.Tensor:
    """[max_pos, d] f32: cos of each position's angles, then sin (the attention kinds' rope)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=1).float()


def add_qk_norms(graph: Graph, inputs: dict[str, torch.Tensor], operands: dict[str, str],
                 d: int, g: torch.Generator) -> None:
    """Qwen3's q_norm / k_norm weights (around 1) as graph weights and attention operands."""
    for name in ("q_norm", "k_norm"):
        graph.add_tensor(name, (d,), BF16, Role.WEIGHT)
        inputs[name] = (1.0 + 0.5 * torch.randn(d, generator=g)).to(torch.bfloat16)
        operands[name] = name


def run_both(graph: Graph, inputs: dict[str, torch.Tensor], outputs: list[str],
             steps: int = 1, num_sms: int = NUM_SMS
             ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run the graph on the CPU interpreter and on the GPU; return both sets of outputs."""
    plan = compile_graph(graph, num_sms=num_sms)
    return tuple(run_on(plan, backend, inputs, outputs, steps)  # type: ignore[return-value]
                 for backend in ("cpu", "cuda"))


def run_on(plan, backend: str, inputs: dict[str, torch.Tensor], outputs: list[str],
           steps: int = 1) -> dict[str, torch.Tensor]:
    """`steps` steps of `plan` on `backend` (poisoned arena) from copies of `inputs`: the
    outputs, on the CPU."""
    ex = create_executor(plan, backend, poison=True)
    # Keep every bound tensor alive while the executor lives (an executor may key caches by
    # data pointer).
    bound = {name: value.clone() for name, value in inputs.items()}
    for name, value in bound.items():
        ex.bind(name, value)
    ex.run(steps)
    got = {name: ex.read(name).cpu() for name in outputs}
    del ex, bound
    return got


def assert_close(cpu: torch.Tensor, gpu: torch.Tensor, name: str, exact: bool = False) -> None:
    assert cpu.shape == gpu.shape and cpu.dtype == gpu.dtype, name
    if not cpu.dtype.is_floating_point or exact:
        if cpu.dtype.is_floating_point:
            assert not torch.isnan(gpu).any(), f"{name}: NaN on the GPU"
            assert torch.equal(cpu.view(torch.int16 if cpu.dtype == torch.bfloat16 else
                                        torch.int32),
                               gpu.view(torch.int16 if gpu.dtype == torch.bfloat16 else
                                        torch.int32)), f"{name}: not bit-identical"
        else:
            diff = (cpu != gpu).nonzero()
            assert diff.numel() == 0, f"{name}: {len(diff)} mismatches, first at {diff[:4].tolist()}"
        return
    c, g = cpu.double(), gpu.double()
    assert not torch.isnan(c).any(), f"{name}: NaN in the CPU reference (test bug)"
    assert not torch.isnan(g).any(), (f"{name}: {int(torch.isnan(g).sum())} NaN on the GPU "
                                      f"(unwritten or wrong elements)")
    inf_c, inf_g = torch.isinf(c), torch.isinf(g)
    assert torch.equal(inf_c, inf_g), f"{name}: infinities differ"
    assert torch.equal(c[inf_c], g[inf_g]), f"{name}: infinities differ in sign"
    c, g = c[~inf_c], g[~inf_g]
    ref = c.norm().item()
    err = (g - c).norm().item()
    assert err <= RTOL * max(ref, 1e-30), f"{name}: relative error {err / max(ref, 1e-30):.3e}"
