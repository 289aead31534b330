"""mpk check: the comparison rules, and the per-layer check against a backend that computes one
layer wrong (the CPU interpreter stands in for the GPU on both sides)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mpk.backends.cpu.interpreter import CpuExecutor
from mpk.check import BF16_TOL, CheckRow, _compare, run_check, token_row
from mpk.compiler.plan import Plan
from mpk.models.config import get_preset
from mpk.models.weights import random_weights

LAYERS = 4
WRONG = 2  # the layer the perturbed backend gets wrong


def test_token_ids_may_differ_only_at_a_near_tie() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    logits[0, 5], logits[0, 9] = 10.0, 10.0 - 1e-4
    near = token_row("argmax_idx", torch.tensor([[9]]), torch.tensor([[5]]), logits, 0)
    assert near.passed and near.tensor == "argmax_idx (near-ties allowed)"
    assert not token_row("argmax_idx", torch.tensor([[0]]), torch.tensor([[5]]), logits, 0).passed
    # tokens_out [steps, batch]: the batch row is axis 1; a poisoned id is never a tie.
    assert token_row("tokens_out", torch.tensor([[9]]), torch.tensor([[5]]), logits, 1).passed
    poison = torch.tensor([[-(2**31) + 7]])
    assert not token_row("tokens_out", poison, torch.tensor([[5]]), logits, 1).passed


def test_equal_infinities_and_nan() -> None:
    a = torch.tensor([float("-inf"), 1.0, 2.0])
    assert _compare("lse", a.clone(), a).passed
    assert not _compare("lse", torch.tensor([0.0, 1.0, 2.0]), a).passed
    assert not _compare("x", torch.tensor([float("nan"), 1.0, 2.0]), a.nan_to_num(0.0)).passed
    assert _compare("x", a.nan_to_num(0.0, 0.0, 0.0) * 1.001, a.nan_to_num(0.0, 0.0, 0.0)).passed


class _WrongWeight(CpuExecutor):
    """A "backend" that computes one layer wrong: it scales one weight (found by its values, so
    the same layer is wrong in the one-layer plans and in the whole-model plan)."""

    def __init__(self, plan: Plan, target: torch.Tensor) -> None:
        super().__init__(plan, order="random", seed=1)
        self.target = target

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.shape == self.target.shape and torch.equal(tensor, self.target):
            tensor = (tensor.float() * 1.5).bfloat16()
        super().bind(name, tensor)


def _model() -> tuple:
    cfg = dataclasses.replace(get_preset("tiny-llama"), num_layers=LAYERS)
    return cfg, random_weights(cfg, seed=3)


def _by_layer(rows: list[CheckRow]) -> dict[int, list[CheckRow]]:
    """The per-layer rows (not the whole-model ones) by the layer they name."""
    out: dict[int, list[CheckRow]] = {layer: [] for layer in range(LAYERS)}
    for row in rows:
        for layer in range(LAYERS):
            if not row.tensor.startswith("whole model") and (
                    f"layers.{layer}." in row.tensor or row.tensor.endswith(f".{layer}")
                    or row.tensor == f"hidden after layer {layer}"):
                out[layer].append(row)
    return out


def test_a_correct_backend_passes_every_layer() -> None:
    cfg, weights = _model()
    rows = run_check(cfg, range(LAYERS), "cpu", seed=3, weights=weights)
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    names = {r.tensor for r in rows}
    # Each layer's output, its KV entries, the tail, the whole-model launch, the reference.
    assert {f"hidden after layer {i}" for i in range(LAYERS)} <= names
    assert {f"k_cache.{i}" for i in range(LAYERS)} <= names
    assert {"logits", "tokens_out", "whole model: hidden", "whole model: logits",
            "whole model: logits vs reference model"} <= names
    assert all(len(r) >= 3 for r in _by_layer(rows).values())


def test_a_wrong_layer_is_caught_there_and_only_there() -> None:
    cfg, weights = _model()
    target = weights[f"model.layers.{WRONG}.mlp.down_proj.weight"]
    rows = run_check(cfg, range(LAYERS), lambda plan: _WrongWeight(plan, target), seed=3,
                     weights=weights)
    layers = _by_layer(rows)
    failed = {r.tensor for r in layers[WRONG] if not r.passed}
    assert f"hidden after layer {WRONG}" in failed
    rel = {r.tensor: r.rel_err for r in layers[WRONG]}
    assert rel[f"hidden after layer {WRONG}"] > 10 * BF16_TOL
    # The layers after it read the backend's (wrong) hidden on both sides: no error carried.
    for layer in (0, 1, 3):
        assert all(r.passed and r.rel_err == 0.0 for r in layers[layer]), layers[layer]
    # The whole-model launch makes the same mistake as the backend's own chain ...
    whole = [r for r in rows
             if r.tensor.startswith("whole model: ") and "reference" not in r.tensor]
    assert whole and all(r.passed for r in whole)
    # ... and only the independent reference model sees it end to end.
    ref = next(r for r in rows if r.tensor == "whole model: logits vs reference model")
    assert not ref.passed


def test_the_whole_model_launch_is_checked_against_the_chain() -> None:
    """A backend whose whole-model plan (and only that one) is wrong: the per-layer rows pass,
    the whole-model rows from the wrong layer on fail."""
    cfg, weights = _model()
    target = weights[f"model.layers.{WRONG}.mlp.down_proj.weight"]

    def make(plan: Plan) -> CpuExecutor:
        whole = sum(t.name.startswith("k_cache.") for t in plan.tensors) > 1
        return _WrongWeight(plan, target) if whole else CpuExecutor(plan)

    rows = {r.tensor: r for r in run_check(cfg, range(LAYERS), make, seed=3, weights=weights)}
    assert all(r.passed for name, r in rows.items() if not name.startswith("whole model"))
    assert not rows["whole model: hidden"].passed and not rows["whole model: logits"].passed
    # Layer WRONG + 1 reads the wrong hidden: its KV entries differ from the chain's.
    assert not rows[f"whole model: k_cache.{WRONG + 1}"].passed
    assert rows[f"whole model: k_cache.{WRONG}"].passed  # written before the wrong MLP


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_cpu_check_of_a_preset(preset: str) -> None:
    rows = run_check(get_preset(preset), range(0, 2), "cpu", seed=0)
    assert rows and all(r.passed for r in rows), [r for r in rows if not r.passed]
