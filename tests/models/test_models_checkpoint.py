"""load_checkpoint / save_checkpoint / random_weights / load_tokenizer."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mpk.errors import CheckpointError
from mpk.models.config import get_preset
from mpk.models.weights import (hf_weight_shapes, load_checkpoint, load_tokenizer,
                                random_weights, save_checkpoint)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == torch.bfloat16, name
        assert torch.equal(a[name], b[name].to(torch.bfloat16)), name


def test_weight_names_and_shapes() -> None:
    q = hf_weight_shapes(get_preset("qwen3-0.6b"))
    assert q["model.layers.0.self_attn.q_proj.weight"] == (2048, 1024)
    assert q["model.layers.27.self_attn.k_norm.weight"] == (128,)
    assert "lm_head.weight" not in q
    l8 = hf_weight_shapes(get_preset("llama-3.1-8b"))
    assert l8["lm_head.weight"] == (128256, 4096)
    assert l8["model.layers.31.mlp.down_proj.weight"] == (4096, 14336)
    assert not any("q_norm" in n for n in l8)
    for name in ("qwen3-8b", "llama-3.1-8b", "tiny-qwen3", "qwen3-30b-a3b", "tiny-qwen3-moe"):
        cfg = get_preset(name)
        shapes = hf_weight_shapes(cfg)
        assert sum(torch.Size(s).numel() for s in shapes.values()) == cfg.num_params
    moe = hf_weight_shapes(get_preset("qwen3-30b-a3b"))
    assert moe["model.layers.47.mlp.gate.weight"] == (128, 2048)
    assert moe["model.layers.0.mlp.experts.127.gate_proj.weight"] == (768, 2048)
    assert moe["model.layers.0.mlp.experts.5.down_proj.weight"] == (2048, 768)
    assert not any(".mlp.gate_proj" in n for n in moe)
    tiny = hf_weight_shapes(get_preset("tiny-qwen3-moe"))  # layer 1 is in mlp_only_layers
    assert tiny["model.layers.1.mlp.gate_proj.weight"] == (96, 64)
    assert "model.layers.1.mlp.gate.weight" not in tiny


def test_random_weights_deterministic_and_sane() -> None:
    cfg = get_preset("tiny-llama")
    a, b, c = random_weights(cfg, 1), random_weights(cfg, 1), random_weights(cfg, 2)
    _assert_same(a, b)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert set(a) == set(hf_weight_shapes(cfg))
    w = a["model.layers.0.mlp.down_proj.weight"].float()
    assert abs(w.std().item() * cfg.intermediate_size ** 0.5 - 1) < 0.1
    norm = a["model.norm.weight"].float()
    assert abs(norm.mean().item() - 1) < 0.05 and 0.05 < norm.std().item() < 0.15


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama", "tiny-qwen3-moe"])
@pytest.mark.parametrize("sharded", [False, True])
def test_load_transformers_checkpoint(tmp_path, name: str, sharded: bool,
                                     make_hf_model) -> None:
    cfg = get_preset(name)
    model = make_hf_model(cfg, seed=3)
    kwargs = {"max_shard_size": "20KB"} if sharded else {}
    model.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    loaded_cfg, weights = load_checkpoint(tmp_path)
    assert loaded_cfg == dataclasses.replace(cfg, name=tmp_path.name)
    _assert_same(weights, random_weights(cfg, 3))


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
@pytest.mark.parametrize("shard", [None, 20_000])
def test_save_checkpoint_round_trip(tmp_path, shard: int | None, name: str) -> None:
    cfg = get_preset(name)
    w = random_weights(cfg, 0)
    save_checkpoint(tmp_path, cfg, w, max_shard_bytes=shard)
    loaded_cfg, loaded = load_checkpoint(tmp_path)
    assert loaded_cfg.num_params == cfg.num_params
    _assert_same(loaded, w)


def test_tied_lm_head_is_dropped_and_extras_ignored_and_fp32_converted(tmp_path) -> None:
    cfg = get_preset("tiny-qwen3")
    w = random_weights(cfg, 0)
    save_checkpoint(tmp_path, cfg, w)
    tensors = {k: v.float() for k, v in load_file(tmp_path / "model.safetensors").items()}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, tmp_path / "model.safetensors")
    _, loaded = load_checkpoint(tmp_path)
    _assert_same(loaded, w)


def _corrupt(tmp_path, edit) -> None:
    cfg = get_preset("tiny-llama")
    save_checkpoint(tmp_path, cfg, random_weights(cfg, 0))
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")


def test_missing_tensor(tmp_path) -> None:
    _corrupt(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(tmp_path)


def test_missing_untied_lm_head(tmp_path) -> None:
    _corrupt(tmp_path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight \[256, 64\] is missing"):
        load_checkpoint(tmp_path)


def test_wrong_shape(tmp_path) -> None:
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64, dtype=torch.bfloat16)
    _corrupt(tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"k_proj\.weight in .*model\.safetensors has "
                                              r"shape \[64, 64\], expected \[128, 64\]"):
        load_checkpoint(tmp_path)


def test_unexpected_tensor(tmp_path) -> None:
    def edit(t):
        t["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64, dtype=torch.bfloat16)
    _corrupt(tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"unexpected tensor .*q_proj\.bias"):
        load_checkpoint(tmp_path)


def test_missing_files(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "absent")
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path)
    cfg = get_preset("tiny-qwen3")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_checkpoint(tmp_path)
    save_checkpoint(tmp_path, cfg, random_weights(cfg, 0), max_shard_bytes=20_000)
    shard = sorted(tmp_path.glob("model-00002-of-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_checkpoint(tmp_path)


def test_load_tokenizer(tmp_path) -> None:
    assert load_tokenizer(tmp_path) is None
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert loaded is not None and loaded.encode("hello world").ids == [0, 1]
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
