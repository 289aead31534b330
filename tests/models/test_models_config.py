"""ModelConfig: presets, validation, and reading Hugging Face config.json dicts."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mpk.errors import CheckpointError, UnsupportedError
from mpk.models.config import PRESETS, ModelConfig, get_preset, load_config

# config.json of the real checkpoints as published on the Hugging Face hub (the fields we read).
QWEN3_06B_JSON = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
LLAMA_32_1B_JSON = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}


def test_param_counts_match_published_sizes() -> None:
    expected = {"qwen3-0.6b": 0.6e9, "qwen3-1.7b": 1.7e9, "qwen3-8b": 8.2e9,
                "llama-3.2-1b": 1.24e9, "llama-3.1-8b": 8.03e9}
    for name, count in expected.items():
        cfg = get_preset(name)
        assert abs(cfg.num_params - count) / count < 0.02, (name, cfg.num_params)
        assert cfg.weight_bytes == 2 * cfg.num_params
        assert cfg.name == name


def test_preset_shapes() -> None:
    q, l8 = get_preset("qwen3-0.6b"), get_preset("llama-3.1-8b")
    assert (q.group, q.qk_norm, q.tie_embeddings, q.head_dim) == (2, True, True, 128)
    assert (l8.group, l8.qk_norm, l8.tie_embeddings) == (4, False, False)
    assert l8.rope_scaling_dict["factor"] == 8.0
    assert get_preset("llama-3.2-1b").rope_scaling_dict["factor"] == 32.0
    assert not get_preset("qwen3-8b").tie_embeddings
    for name in ("tiny-qwen3", "tiny-llama"):
        assert get_preset(name).num_params < 200_000


def test_get_preset_error_lists_names() -> None:
    with pytest.raises(UnsupportedError, match="qwen3-0.6b"):
        get_preset("gpt-5")


def test_real_config_json_matches_presets() -> None:
    for d, preset in ((QWEN3_06B_JSON, "qwen3-0.6b"), (LLAMA_32_1B_JSON, "llama-3.2-1b")):
        assert ModelConfig.from_hf(d, name=preset) == get_preset(preset)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_round_trip_through_transformers_config(name: str, make_hf_config) -> None:
    cfg = get_preset(name)
    assert ModelConfig.from_hf(cfg.to_hf(), name=name) == cfg
    # transformers re-encodes rope settings (rope_parameters in 5.x): read its to_dict() back.
    assert ModelConfig.from_hf(make_hf_config(cfg).to_dict(), name=name) == cfg


def test_from_hf_details() -> None:
    d = dict(LLAMA_32_1B_JSON, eos_token_id=[128001, 128008, 128009])
    del d["head_dim"]
    cfg = ModelConfig.from_hf(d)
    assert cfg.eos_token_ids == (128001, 128008, 128009)
    assert cfg.head_dim == 64  # hidden / heads
    d = dict(QWEN3_06B_JSON, eos_token_id=None, bos_token_id=None)
    del d["model_type"]  # falls back to architectures
    cfg = ModelConfig.from_hf(d)
    assert (cfg.arch, cfg.eos_token_ids, cfg.bos_token_id) == ("qwen3", (), None)
    old = dict(LLAMA_32_1B_JSON, rope_scaling={**LLAMA_32_1B_JSON["rope_scaling"]})
    old["rope_scaling"]["type"] = old["rope_scaling"].pop("rope_type")
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(LLAMA_32_1B_JSON)
    default = dict(QWEN3_06B_JSON, rope_scaling={"rope_type": "default"})
    assert ModelConfig.from_hf(default).rope_scaling is None


@pytest.mark.parametrize("change, match", [
    ({"model_type": "mistral"}, "supported: \\['llama', 'qwen3'\\]"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "sliding"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"num_key_value_heads": 5}, "num_kv_heads 5"),
])
def test_unsupported_configs(change: dict, match: str) -> None:
    with pytest.raises(UnsupportedError, match=match):
        ModelConfig.from_hf(dict(QWEN3_06B_JSON, **change))


def test_missing_key_is_checkpoint_error() -> None:
    d = dict(QWEN3_06B_JSON)
    del d["intermediate_size"]
    with pytest.raises(CheckpointError, match="intermediate_size"):
        ModelConfig.from_hf(d)


def test_validation() -> None:
    cfg = get_preset("tiny-qwen3")
    with pytest.raises(UnsupportedError, match="qk_norm"):
        dataclasses.replace(cfg, qk_norm=False)
    with pytest.raises(UnsupportedError, match="head_dim"):
        dataclasses.replace(cfg, head_dim=15)
    with pytest.raises(UnsupportedError, match="arch"):
        dataclasses.replace(cfg, arch="gpt2")
    hash(get_preset("tiny-llama"))  # usable as a cache key


def test_load_config(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_config(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B_JSON))
    cfg = load_config(tmp_path)
    assert cfg == dataclasses.replace(get_preset("qwen3-0.6b"), name=tmp_path.name)
