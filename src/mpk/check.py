"""`mpk check`: a backend against the CPU interpreter, layer by layer, fed the backend's own input.

Comparing two whole runs of a deep model cannot tell a wrong layer from legitimate rounding:
bf16 differences of ~1e-3 per layer compound, and on random weights layer 28's buffers of a
correct GPU run are 1-2% off the interpreter's. So each layer is checked on its own (correctness
gate 4): both sides run the same ONE-LAYER plan (layer L's weights renumbered as layer 0; a
MoE model's dense and expert layers each get a plan of their own kind), one decode step per
launch, fed the same inputs: the hidden state the backend itself produced before layer L
(injected through the embedding: a table whose row i is that hidden row, prompt ids 0..B-1)
and the KV history the backend wrote for layer L. Every activation both sides hold is
compared, plus 'hidden' after the layer, the new KV entries, and, after the last layer, the
logits and sampled tokens. The backend's output then feeds layer L+1, on both sides, so an error
is reported at the layer that makes it and cannot grow downstream.

The one-layer chain does not run the real multi-layer megakernel, so the backend also runs the
whole sliced model as one multi-step launch, and each of its buffers is compared with the same
backend's chain (same kernels, same inputs: equal unless scheduling across layers or steps is
wrong; this assumes the backend is deterministic, as the megakernel's fixed-order reductions
are). Finally the logits are compared with the independent PyTorch reference model.

Nothing here lists buffer names except the graph's IO contract (docs/architecture.md) and the
embedding op's operands: whatever activations the plans hold are compared, so fusing or
renaming intermediates needs no change here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mpk.backends.base import Executor
from mpk.backends.registry import CPU_NUM_SMS, create_executor, get_backend
from mpk.compiler.lower import compile_graph
from mpk.compiler.plan import Plan
from mpk.dtypes import DType
from mpk.engine.bind import bind_model
from mpk.errors import UnsupportedError
from mpk.models.builder import DecodeShape, build_graph
from mpk.models import decode_io as io
from mpk.models.config import ModelConfig
from mpk.models.reference import ReferenceModel
from mpk.models.weights import random_weights

BF16_TOL = 1e-2
# The independent reference model rounds to bf16 at other points than the graph does, and on
# random weights that difference grows with depth: whole qwen3-0.6b / llama-3.2-1b logits differ
# by 1.5-2% from the interpreter's (one layer: < 1e-3). Backend vs interpreter stays at BF16_TOL.
REFERENCE_TOL = 3e-2
# IO tensors the check writes itself (the graph's IO contract): equal on both sides by design.
INPUTS = io.INPUTS
# Integer outputs that hold token ids, and the axis of their batch row: a differing id is
# accepted at a near-tie of the logits (bf16 rounding may pick either of two equal logits).
TOKEN_IDS = {"argmax_idx": 0, "tokens": 0, "tokens_out": 1}
# A layer-scoped tensor name: layer index 0 as a dotted component ("layers.0.qkv", "k_cache.0").
_LAYER0 = re.compile(r"(?<![^.])0(?![^.])")

ExecutorFactory = Callable[[Plan], Executor]


@dataclass(frozen=True)
class CheckRow:
    tensor: str
    rel_err: float
    tolerance: float
    passed: bool


def slice_config(cfg: ModelConfig, layers: range) -> ModelConfig:
    """The model with only `layers` (renumbered from 0): same shapes, fewer layers, each of the
    kind it was (a MoE model's dense layers become the slice's mlp_only_layers)."""
    if not layers or layers.step != 1 or layers.start < 0 or layers.stop > cfg.num_layers:
        raise UnsupportedError(f"layers {_span(layers)} are out of range: "
                               f"{cfg.name or 'the model'} has layers 0-{cfg.num_layers - 1}")
    moe = {}
    if cfg.is_moe:
        moe = {"decoder_sparse_step": 1, "mlp_only_layers": tuple(
            i for i, layer in enumerate(layers) if not cfg.is_moe_layer(layer))}
    return dataclasses.replace(cfg, num_layers=len(layers), **moe)


def _span(layers: range) -> str:
    return str(layers.start) if len(layers) == 1 else f"{layers.start}-{layers.stop - 1}"


def slice_weights(weights: dict[str, torch.Tensor], layers: range) -> dict[str, torch.Tensor]:
    """The HF-named weights of `layers` renumbered from 0, plus every non-layer weight."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith("model.layers."):
            index, rest = name[len("model.layers."):].split(".", 1)
            if int(index) not in layers:
                continue
            name = f"model.layers.{int(index) - layers.start}.{rest}"
        out[name] = tensor
    return out


def run_check(cfg: ModelConfig, layers: range, backend: str | ExecutorFactory, seed: int = 0,
              num_sms: int | None = None, steps: int = 2,
              weights: dict[str, torch.Tensor] | None = None, batch: int = 1) -> list[CheckRow]:
    """Rows of the per-layer check, the whole-model launch and the reference model (see the
    module doc). `backend`: "cpu", "cuda", or a function making an executor for a plan (tests).
    `weights`: the whole model's (a checkpoint's), cut to `layers`; by default random weights
    of the slice alone, drawn from `seed`. `batch`: rows decoded together, each its own prompt."""
    weights = (slice_weights(weights, layers) if weights is not None
               else random_weights(slice_config(cfg, layers), seed=seed))
    cfg = slice_config(cfg, layers)
    make = _factory(backend, seed)
    if num_sms is None:
        num_sms = get_backend(backend).num_sms() if isinstance(backend, str) else CPU_NUM_SMS
    # Every row owns max_pages pages of the shuffled pool (bind_model).
    shape = DecodeShape(batch=batch, steps_per_launch=steps, page_size=16, max_pages=4,
                        num_pages=max(8, 4 * batch))
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (steps, shape.batch), generator=gen,
                           dtype=torch.int32)
    full_plan = compile_graph(build_graph(cfg, shape, num_sms=num_sms), num_sms)
    # The noise-filled KV caches and page table of a whole-model binding: the chain starts
    # from the same state, so the two backend runs must end in the same state.
    state = _Recorder(full_plan)
    bind_model(state, full_plan, cfg, shape, weights, seed)

    chain = _LayerChain(cfg, weights, shape, num_sms, make, state.tensors)
    rows, chain_final = chain.run(prompt)

    full = make(full_plan)
    for name, tensor in state.tensors.items():
        full.bind(name, tensor.clone() if name not in state.weights else tensor)
    full.write("prompt", prompt)
    full.run(steps)
    got = _outputs(full, full_plan)
    logits = chain_final.get("logits")
    rows += [_compare_any(f"whole model: {name}", name, got[name], chain_final[name], logits)
             for name in got if name in chain_final and got[name].shape == chain_final[name].shape]

    ref = ReferenceModel(cfg, weights, max_seq=shape.max_seq_len)
    want = ref.forward(prompt.T.long(), 0)[:, -1]
    rows.append(_compare("whole model: logits vs reference model", got["logits"], want,
                         REFERENCE_TOL))
    return rows


class _LayerChain:
    """Each layer on the backend and on the interpreter, fed the backend's previous output."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], shape: DecodeShape,
                 num_sms: int, make: ExecutorFactory, initial: dict[str, torch.Tensor]) -> None:
        self.cfg, self.weights, self.make, self.initial = cfg, weights, make, initial
        self.num_sms = num_sms
        self.shape = dataclasses.replace(shape, steps_per_launch=1)
        self.plans: dict[ModelConfig, Plan] = {}  # one per kind of layer (dense MLP, experts)
        _, plan = self._plan(0)  # the embedding is not layer-scoped: same names in every plan
        embed = next(op for op in plan.ops if op.kind == "embedding")
        names = {operand: plan.tensors[tid].name for operand, tid in embed.operands}
        self.table, self.hidden = names["table"], names["out"]

    def _plan(self, layer: int) -> tuple[ModelConfig, Plan]:
        """The one-layer model of layer `layer` (its kind kept) and its plan."""
        one = slice_config(self.cfg, range(layer, layer + 1))
        if one not in self.plans:
            graph = build_graph(one, self.shape, num_sms=self.num_sms)
            self.plans[one] = compile_graph(graph, self.num_sms)
        return one, self.plans[one]

    def run(self, prompt: torch.Tensor) -> tuple[list[CheckRow], dict[str, torch.Tensor]]:
        """All rows (worst step per tensor), and the backend's last-step buffers under the
        whole-model plan's names (tokens_out: every step's row)."""
        rows: list[CheckRow] = []
        final: dict[str, torch.Tensor] = {}
        hidden: list[torch.Tensor] | None = None  # the backend's input to this layer, per step
        for layer in range(self.cfg.num_layers):
            last = layer == self.cfg.num_layers - 1
            step_rows, outs = self._layer(layer, prompt, hidden)
            hidden = [o[self.hidden] for o in outs]
            rows += _worst(step_rows)
            for name, value in outs[-1].items():
                if _LAYER0.search(name):
                    final[_LAYER0.sub(str(layer), name)] = value
                elif last and name != "tokens_out":
                    final[name] = value
            if last:
                final["tokens_out"] = torch.cat([o["tokens_out"] for o in outs])
        return rows, final

    def _layer(self, layer: int, prompt: torch.Tensor, hidden: list[torch.Tensor] | None
               ) -> tuple[list[CheckRow], list[dict[str, torch.Tensor]]]:
        last = layer == self.cfg.num_layers - 1
        one, plan = self._plan(layer)
        backend, interp = self.make(plan), create_executor(plan, "cpu")
        table = None
        if hidden is not None:
            spec = plan.tensor(self.table)
            table = torch.zeros(spec.shape, dtype=DType(spec.dtype).torch)
        for ex in (backend, interp):
            self._bind(ex, plan, one, layer, table)
        rows, outs = [], []
        batch = self.shape.batch
        for step in range(prompt.shape[0]):
            if table is None:  # layer 0: the real embedding of the real prompt
                ids = prompt[step: step + 1]
            else:  # row i of the table is the backend's hidden row i before this layer
                table[:batch] = hidden[step]
                ids = torch.arange(batch, dtype=torch.int32)[None]
            for ex in (backend, interp):
                if table is not None:
                    ex.write(self.table, table)
                ex.write("prompt", ids)
                ex.write("positions", torch.full((batch,), step, dtype=torch.int32))
            for kv in ("k_cache.0", "v_cache.0"):  # the backend's own KV history
                interp.write(kv, backend.read(kv))
            backend.run(1)
            interp.run(1)
            got, want = _outputs(backend, plan), _outputs(interp, plan)
            logits = want.get("logits")
            for name in got:
                if _LAYER0.search(name):
                    label = _LAYER0.sub(str(layer), name)
                elif name == self.hidden:
                    label = f"{name} after layer {layer}"
                elif last:  # the model's tail: logits, sampled tokens
                    label = name
                else:
                    continue
                rows.append(_compare_any(label, name, got[name], want[name], logits))
            outs.append(got)
        return rows, outs

    def _bind(self, ex: Executor, plan: Plan, one: ModelConfig, layer: int,
              table: torch.Tensor | None) -> None:
        """Layer `layer`'s weights as layer 0 of `one` (its one-layer model, planned as `plan`),
        and the whole model's initial KV noise of that layer and page table (so the chain and the
        whole-model launch start alike)."""
        weights = slice_weights(self.weights, range(layer, layer + 1))
        bind_model(ex, plan, one, self.shape, weights, seed=0)
        for kv in ("k_cache", "v_cache"):
            ex.bind(f"{kv}.0", self.initial[f"{kv}.{layer}"].clone())
        ex.bind("page_table", self.initial["page_table"].clone())
        if table is not None:
            ex.bind(self.table, table)


class _Recorder:
    """An executor that only keeps what is bound to it (to reuse bind_model's state)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.tensors: dict[str, torch.Tensor] = {}
        self.weights = {t.name for t in plan.tensors if t.role == "weight"}

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors[name] = tensor


def _factory(backend: str | ExecutorFactory, seed: int) -> ExecutorFactory:
    if callable(backend):
        return backend
    if backend == "cuda":  # poisoned arena: an element no task writes shows up as NaN
        return lambda plan: create_executor(plan, "cuda", poison=True)
    # The CPU backend in a random valid task order, so missing dependencies show too.
    return lambda plan: create_executor(plan, backend, order="random", seed=seed)


def _outputs_names(plan: Plan) -> list[str]:
    """What a run produces: activations and IO buffers, less the inputs the check writes (not
    weights, nor tensors a backend derives from them)."""
    return [t.name for t in plan.tensors
            if t.role in ("activation", "io") and t.name not in INPUTS]


def _outputs(ex: Executor, plan: Plan) -> dict[str, torch.Tensor]:
    return {name: ex.read(name) for name in _outputs_names(plan)}


def _worst(rows: list[CheckRow]) -> list[CheckRow]:
    """One row per tensor: the worst over the steps (NaN counts as worst), first-seen order."""
    worst: dict[str, CheckRow] = {}
    for row in rows:
        old = worst.get(row.tensor)
        if old is None or _badness(row) > _badness(old):
            worst[row.tensor] = row
    return list(worst.values())


def _badness(row: CheckRow) -> tuple[bool, float]:
    return (not row.passed, math.inf if math.isnan(row.rel_err) else row.rel_err)


def _compare_any(label: str, name: str, got: torch.Tensor, want: torch.Tensor,
                 logits: torch.Tensor | None) -> CheckRow:
    """_compare of tensor `name` (reported as `label`), except that token ids may differ at a
    near-tie of `logits` (the want side's)."""
    if name in TOKEN_IDS and logits is not None and not torch.equal(got, want):
        return token_row(label, got, want, logits, TOKEN_IDS[name])
    return _compare(label, got, want)


def token_row(name: str, got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor,
              batch_axis: int) -> CheckRow:
    """Token ids compared up to near-ties: where an id differs, the gap between the two ids'
    logits (batch row's logits, in units of their std) must stay within BF16_TOL."""
    vocab = logits.shape[-1]
    worst = 0.0
    for index in (got != want).nonzero().tolist():
        a, b = int(got[tuple(index)]), int(want[tuple(index)])
        if not (0 <= a < vocab and 0 <= b < vocab):
            return CheckRow(name, math.inf, BF16_TOL, False)  # poison or garbage, not a tie
        row = logits[index[batch_axis]].double()
        worst = max(worst, float((row[a] - row[b]).abs() / row.std()))
    return CheckRow(f"{name} (near-ties allowed)", worst, BF16_TOL, worst <= BF16_TOL)


def _compare(name: str, got: torch.Tensor, want: torch.Tensor,
             tol: float = BF16_TOL) -> CheckRow:
    if not want.dtype.is_floating_point:
        same = bool(torch.equal(got, want))
        return CheckRow(name, 0.0 if same else 1.0, 0.0, same)
    g, w = got.double(), want.double()
    if torch.isnan(w).any() or torch.isnan(g).any():
        return CheckRow(name, float("nan"), tol, False)
    same = g == w  # equal infinities (e.g. the lse of an empty KV split) count as exact
    if bool((~same & (torch.isinf(g) | torch.isinf(w))).any()):
        return CheckRow(name, float("inf"), tol, False)
    g, w = torch.where(same, 0.0, g), torch.where(same, 0.0, w)
    err = float((g - w).norm() / max(float(want.double().nan_to_num(0, 0, 0).norm()), 1e-30))
    return CheckRow(name, err, tol, err <= tol)
