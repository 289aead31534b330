"""Broken Hugging Face checkpoints a new user may hit: one `mpk: error:` line that names the
file, exit 2, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mpk.cli import main
from mpk.errors import CheckpointError, UnsupportedError
from mpk.models.config import get_preset, load_config
from mpk.models.weights import load_checkpoint, random_weights, save_checkpoint


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    cfg = get_preset("tiny-llama")
    save_checkpoint(tmp_path, cfg, random_weights(cfg, seed=0))
    return tmp_path


def _generate(capsys: pytest.CaptureFixture[str], folder: Path) -> tuple[int, str]:
    code = main(["generate", "--checkpoint", str(folder), "--backend", "cpu",
                 "--max-new-tokens", "1"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_damaged_safetensors(checkpoint: Path, capsys, damage: str) -> None:
    file = checkpoint / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes({"truncated": data[: len(data) // 2], "empty": b"",
                      "garbage": np.random.default_rng(1).bytes(4096)}[damage])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(checkpoint)
    code, err = _generate(capsys, checkpoint)
    assert code == 2, err
    assert err.startswith("mpk: error: ") and err.count("\n") == 1 and str(file) in err, err


def test_architectures_must_match_model_type(checkpoint: Path, capsys) -> None:
    file = checkpoint / "config.json"
    config = json.loads(file.read_text())
    assert config["model_type"] == "llama"
    config["architectures"] = ["GPT2LMHeadModel"]
    file.write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="GPT2LMHeadModel.*do not match model_type"):
        load_config(checkpoint)
    code, err = _generate(capsys, checkpoint)
    assert code == 2 and err.count("\n") == 1 and str(file) in err, err
    config["architectures"] = ["Qwen3ForCausalLM"]  # a supported class, but not this model type
    file.write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="Qwen3ForCausalLM"):
        load_config(checkpoint)
    config["architectures"] = ["LlamaForCausalLM"]
    file.write_text(json.dumps(config))
    assert load_config(checkpoint).arch == "llama"


def test_config_that_is_not_an_object(checkpoint: Path, capsys) -> None:
    (checkpoint / "config.json").write_text("[1, 2]")
    code, err = _generate(capsys, checkpoint)
    assert code == 2 and "config.json" in err and err.count("\n") == 1, err
