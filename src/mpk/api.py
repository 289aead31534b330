"""PersistentKernel: the user-facing API, in the spirit of the original MPK.

    pk = mpk.PersistentKernel(num_sms=132)
    x = pk.attach("x", x_tensor, io=True)            # user-owned tensors
    w = pk.attach("w", weight)                       # weights are read-only
    y = pk.new_tensor("y", (1, 4096))                # activations live in the kernel's arena
    pk.linear("proj", grid=(64,), operands={"x": x, "weight": w, "out": y})
    kernel = pk.compile(backend="cpu")               # or "cuda"
    kernel()                                         # one decode step
    print(kernel["y"])

`pk.<kind>(...)` works for every registered task kind (it is `pk.layer(kind, ...)`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mpk.backends.base import Executor
from mpk.backends.registry import create_executor
from mpk.compiler.lower import compile_graph
from mpk.compiler.plan import Plan
from mpk.dtypes import DType
from mpk.errors import GraphError
from mpk.graph.graph import DEFAULT_NUM_SMS, Graph, Op
from mpk.tasks.base import Split
from mpk.tasks.registry import all_kinds
from mpk.tensors import Role, TensorSpec


class PersistentKernel:
    def __init__(self, num_sms: int = DEFAULT_NUM_SMS) -> None:
        self.num_sms = num_sms
        self.graph = Graph()
        self._attached: dict[str, torch.Tensor] = {}

    def attach(self, name: str, tensor: torch.Tensor, io: bool = False) -> TensorSpec:
        """Use an existing tensor (no copy). io=True lets the kernel write it."""
        if not isinstance(tensor, torch.Tensor):
            raise GraphError(f"attach({name!r}): expected a torch.Tensor, got {type(tensor)}")
        try:
            dtype = DType.of(tensor.dtype)
        except ValueError as e:
            raise GraphError(f"attach({name!r}): {e}") from None
        spec = self.graph.add_tensor(name, tuple(tensor.shape), dtype,
                                     Role.IO if io else Role.WEIGHT)
        self._attached[name] = tensor
        return spec

    def new_tensor(self, name: str, shape: tuple[int, ...],
                   dtype: torch.dtype = torch.bfloat16) -> TensorSpec:
        """A scratch tensor in the kernel's arena (readable after a run)."""
        return self.graph.add_tensor(name, shape, DType.of(dtype), Role.ACTIVATION)

    def layer(self, kind: str, name: str, grid: tuple[int, ...],
              operands: Mapping[str, str | TensorSpec],
              splits: Mapping[str, Split] | None = None, **attrs: Any) -> Op:
        """Declare one layer: a task kind, a 3-D grid, its operands and how the grid splits them
        (per operand: for each grid axis, the tensor dim it splits or None)."""
        return self.graph.add_op(kind, name, grid, operands, splits, **attrs)

    def __getattr__(self, kind: str) -> Any:
        if kind.startswith("_") or kind not in all_kinds():
            raise AttributeError(kind)

        def add(name: str, grid: tuple[int, ...], operands: Mapping[str, str | TensorSpec],
                splits: Mapping[str, Split] | None = None, **attrs: Any) -> Op:
            return self.layer(kind, name, grid, operands, splits, **attrs)

        add.__doc__ = all_kinds()[kind].__doc__
        return add

    def compile(self, backend: str = "cpu", **options: Any) -> CompiledKernel:
        plan = compile_graph(self.graph, self.num_sms)
        executor = create_executor(plan, backend, **options)
        for name, tensor in self._attached.items():
            executor.bind(name, tensor)
        return CompiledKernel(plan, executor)


class CompiledKernel:
    """A compiled Plan bound to a backend: call it to run decode steps."""

    def __init__(self, plan: Plan, executor: Executor) -> None:
        self.plan = plan
        self.executor = executor

    def __call__(self, num_steps: int = 1) -> None:
        self.executor.run(num_steps)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.executor.read(name)

    def write(self, name: str, value: torch.Tensor) -> None:
        self.executor.write(name, value)
