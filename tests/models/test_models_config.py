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
# Qwen/Qwen3-30B-A3B's config.json (the fields we read, and the MoE ones we ignore).
QWEN3_30B_A3B_JSON = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_param_counts_match_published_sizes() -> None:
    expected = {"qwen3-0.6b": 0.6e9, "qwen3-1.7b": 1.7e9, "qwen3-8b": 8.2e9,
                "llama-3.2-1b": 1.24e9, "llama-3.1-8b": 8.03e9, "qwen3-30b-a3b": 30.5e9}
    for name, count in expected.items():
        cfg = get_preset(name)
        assert abs(cfg.num_params - count) / count < 0.02, (name, cfg.num_params)
        assert cfg.weight_bytes == 2 * cfg.num_params
        assert cfg.name == name
        assert cfg.active_params == cfg.num_params or cfg.is_moe


def test_moe_active_params() -> None:
    """Qwen3-30B-A3B reads 3.3B parameters per token (its name's A3B): the issue's ~6.1 GB is
    that minus the untied embedding table, which a step only indexes."""
    cfg = get_preset("qwen3-30b-a3b")
    assert abs(cfg.active_params - 3.35e9) / 3.35e9 < 0.01
    embed_bytes = 2 * cfg.vocab_size * cfg.hidden_size
    assert abs(2 * cfg.active_params - embed_bytes - 6.08e9) / 6.08e9 < 0.01
    dense = get_preset("tiny-qwen3")
    assert dense.active_params == dense.num_params and not dense.is_moe


def test_moe_layer_rule_follows_transformers() -> None:
    """Qwen3MoeDecoderLayer: sparse unless in mlp_only_layers; every decoder_sparse_step-th."""
    cfg = dataclasses.replace(get_preset("tiny-qwen3-moe"), num_layers=6, mlp_only_layers=(3,),
                              decoder_sparse_step=2)
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    tiny = get_preset("tiny-qwen3-moe")
    assert [tiny.is_moe_layer(i) for i in range(3)] == [True, False, True]

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
    for d, preset in ((QWEN3_06B_JSON, "qwen3-0.6b"), (LLAMA_32_1B_JSON, "llama-3.2-1b"),
                      (QWEN3_30B_A3B_JSON, "qwen3-30b-a3b")):
        assert ModelConfig.from_hf(d, name=preset) == get_preset(preset)
    # transformers 5.x writes num_experts as num_local_experts; mlp_only_layers is a set there
    d = dict(QWEN3_30B_A3B_JSON, num_local_experts=128, mlp_only_layers=[5, 2, 5])
    del d["num_experts"]
    cfg = ModelConfig.from_hf(d)
    assert (cfg.num_experts, cfg.mlp_only_layers) == (128, (2, 5))


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
    ({"model_type": "mistral"}, "supported: \\['llama', 'qwen3', 'qwen3_moe'\\]"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "sliding"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"num_key_value_heads": 5}, "num_kv_heads 5"),
])
def test_unsupported_configs(change: dict, match: str) -> None:
    with pytest.raises(UnsupportedError, match=match):
        ModelConfig.from_hf(dict(QWEN3_06B_JSON, **change))


@pytest.mark.parametrize("change, match", [
    ({"num_experts_per_tok": 129}, "num_experts_per_tok 129 exceeds num_experts 128"),
    ({"num_experts": 0}, "num_experts must be a positive int"),
    ({"moe_intermediate_size": -1}, "moe_intermediate_size must be a positive int"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive int"),
    ({"mlp_only_layers": [48]}, "mlp_only_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_moe_configs(change: dict, match: str) -> None:
    with pytest.raises(UnsupportedError, match=match):
        ModelConfig.from_hf(dict(QWEN3_30B_A3B_JSON, **change))


def test_moe_missing_key_and_dense_fields() -> None:
    d = dict(QWEN3_30B_A3B_JSON)
    del d["num_experts_per_tok"]
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        ModelConfig.from_hf(d)
    with pytest.raises(UnsupportedError, match="only for arch 'qwen3_moe'"):
        dataclasses.replace(get_preset("tiny-qwen3"), num_experts=4)
    with pytest.raises(UnsupportedError, match="mlp_only_layers"):
        dataclasses.replace(get_preset("tiny-qwen3-moe"), mlp_only_layers=(1, 0))


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
