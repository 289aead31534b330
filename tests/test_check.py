"""mpk check: the comparison rules, and the per-layer check against a backend that computes one
layer wrong (the CPU interpreter stands in for the GPU on both sides)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mpk.backends.cpu.interpreter import CpuExecutor
from mpk.check import (
    BF16_TOL,
    REFERENCE_TOL,
    CheckRow,
    _compare,
    run_check,
    slice_config,
    token_row,
)
from mpk.cli import main
from mpk.cli_commands import _check_layers
from mpk.compiler.plan import Plan
from mpk.errors import UnsupportedError
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
    rows = run_check(get_preset(preset), range(2), "cpu", seed=0)
    assert rows and all(r.passed for r in rows), [r for r in rows if not r.passed]


def test_cpu_check_of_a_moe_model_covers_both_kinds_of_layer() -> None:
    """tiny-qwen3-moe: layers 0 and 2 route through experts, layer 1 (mlp_only) is dense. Each
    is checked on its own one-layer plan of its own kind, at the dense path's tolerances."""
    cfg = get_preset("tiny-qwen3-moe")
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True]
    rows = run_check(cfg, range(3), "cpu", seed=0)
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    tol = {r.tensor: r.tolerance for r in rows}
    for layer in range(3):
        assert tol[f"hidden after layer {layer}"] == BF16_TOL
        assert tol[f"k_cache.{layer}"] == BF16_TOL
    for layer in (0, 2):  # the router and the experts of each MoE layer
        assert tol[f"layers.{layer}.expert_ids"] == 0.0  # ids: exact
        assert tol[f"layers.{layer}.expert_act"] == BF16_TOL
        assert f"layers.{layer}.act" not in tol
        assert f"whole model: layers.{layer}.expert_act" in tol
    assert tol["layers.1.act"] == BF16_TOL  # the dense MLP's activation
    assert not any(name.startswith("layers.1.expert") for name in tol)
    assert "whole model: layers.1.act" in tol
    assert tol["whole model: logits vs reference model"] == REFERENCE_TOL
    assert {"logits", "whole model: logits"} <= set(tol)


def test_slicing_a_moe_model_keeps_each_layers_kind() -> None:
    cfg = dataclasses.replace(get_preset("qwen3-30b-a3b"), decoder_sparse_step=2,
                              mlp_only_layers=(5, 6))
    for layers in (range(1), range(1, 2), range(3, 8), range(48)):
        cut = slice_config(cfg, layers)
        assert cut.num_layers == len(layers)
        assert [cut.is_moe_layer(i) for i in range(len(layers))] == \
            [cfg.is_moe_layer(i) for i in layers]
    assert slice_config(get_preset("tiny-qwen3"), range(1, 2)).mlp_only_layers == ()
    # The default range of `mpk check`: both kinds where a MoE model has both.
    assert _check_layers(get_preset("tiny-qwen3-moe")) == range(2)
    assert _check_layers(get_preset("qwen3-30b-a3b")) == range(1)  # experts only
    assert _check_layers(get_preset("tiny-qwen3")) == range(1)
    with pytest.raises(UnsupportedError, match="layers 2-4 are out of range: tiny-qwen3-moe "
                                               "has layers 0-2"):
        run_check(get_preset("tiny-qwen3-moe"), range(2, 5), "cpu")


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_mpk_check_of_a_moe_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = _cli(capsys, "check", "--model", "tiny-qwen3-moe", "--backend", "cpu",
                        "--json")
    result = json.loads(out)
    assert code == 0 and result["passed"] and result["layers"] == [0, 1]
    names = {r["tensor"] for r in result["rows"]}
    assert {"layers.0.expert_act", "layers.1.act"} <= names
    # Misconfigured: one `mpk: error:` line each, no traceback.
    code, _, err = _cli(capsys, "check", "--model", "tiny-qwen3-moe", "--layers", "1-3",
                        "--backend", "cpu")
    assert code == 2 and err.strip() == ("mpk: error: --layers 1-3 is out of range: "
                                         "tiny-qwen3-moe has layers 0-2")
    hf = get_preset("tiny-qwen3-moe").to_hf() | {"mlp_only_layers": [1, 3]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    code, _, err = _cli(capsys, "check", "--checkpoint", str(tmp_path), "--backend", "cpu")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("mpk: error: ")
    assert "mlp_only_layers must be a sorted tuple of distinct layer indices in [0, 3)" in lines[0]


class _WrongRow(CpuExecutor):
    """A "backend" that feeds one batch row another token: only that row's values differ."""

    def __init__(self, plan: Plan, row: int, vocab: int) -> None:
        super().__init__(plan)
        self.row, self.vocab = row, vocab

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name == "prompt":
            tensor = tensor.clone()
            tensor[..., self.row] = (tensor[..., self.row] + 1) % self.vocab
        super().write(name, tensor)


def test_a_batch_of_16_is_checked_row_by_row() -> None:
    """`mpk check --batch 16`: every row has its own prompt and pages; a correct backend passes,
    and one whose row 12 alone (past the kernels' first group of 8 rows) goes wrong is caught."""
    cfg, weights = _model()
    rows = run_check(cfg, range(LAYERS), "cpu", seed=3, weights=weights, batch=16)
    assert all(r.passed for r in rows), [r for r in rows if not r.passed]
    wrong = {r.tensor: r for r in run_check(cfg, range(LAYERS),
                                            lambda plan: _WrongRow(plan, 12, cfg.vocab_size),
                                            seed=3, weights=weights, batch=16)}
    assert not wrong["hidden after layer 0"].passed
    assert not wrong["whole model: logits vs reference model"].passed


def test_cpu_check_with_attention_query_head_parts() -> None:
    """A group of 8 query heads a KV head: at batch 1 on 132 SMs the builder parts each KV
    head's query heads over four attention tasks (models/builder.py _query_parts); every
    layer's buffers and the whole model still match the reference."""
    import dataclasses

    from mpk.models.builder import DecodeShape, build_graph

    cfg = dataclasses.replace(get_preset("tiny-qwen3"), num_heads=8, num_kv_heads=1)
    assert cfg.group == 8
    graph = build_graph(cfg, DecodeShape(max_pages=4), num_sms=132)  # as run_check: one split
    assert {op.grid for op in graph.ops if op.kind == "attention"} == {(4, 1, 1)}
    rows = run_check(cfg, range(2), "cpu", seed=0, num_sms=132)
    assert rows and all(r.passed for r in rows), [r for r in rows if not r.passed]
