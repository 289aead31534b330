"""GGUF checkpoints on small files written with the gguf package as llama.cpp writes them:
config from metadata, names, the Llama q/k un-permutation, every supported quant type against
transformers' own GGUF loader, the tokenizer and chat template, and one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from mpk.cli import main
from mpk.errors import CheckpointError, MpkError, UnsupportedError
from mpk.models.chat import load_chat_template
from mpk.models.config import ModelConfig, get_preset, load_config
from mpk.models.gguf import SUPPORTED_TYPES, find_gguf, unpermute_qk
from mpk.models.weights import load_checkpoint, load_tokenizer, random_weights
from tests.models.gguf_files import K_QUANTS, byte_level_tokenizer, llama_cpp_permute, write_gguf


def _wide(name: str) -> ModelConfig:
    """A preset widened so every row is a whole number of 256-wide K-quant blocks."""
    return dataclasses.replace(get_preset(name), hidden_size=256, intermediate_size=256,
                               num_heads=4, num_kv_heads=2, head_dim=64)


def _transformers_weights(path: Path, cfg: ModelConfig, hf_config) -> dict[str, torch.Tensor]:
    """transformers' GGUF loader (its own names, its own Llama reverse permutation)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cls = transformers.Qwen3ForCausalLM if cfg.arch == "qwen3" else transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = cls(hf_config(cfg))
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]


def _one_line_error(excinfo: pytest.ExceptionInfo, path: Path) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and str(path) in message, message
    return message


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_f32_gguf_gives_back_config_and_weights(tmp_path, name: str) -> None:
    """F32 is lossless for bf16 weights, so loading must give back exactly what was written:
    names, shapes and (for Llama) the undone q/k permutation, plus the whole config."""
    cfg = get_preset(name)
    weights = random_weights(cfg, seed=5)
    path = write_gguf(tmp_path / "m.gguf", cfg, weights, rope_freqs=cfg.rope_scaling is not None)
    got_cfg, got = load_checkpoint(path)
    assert got_cfg == dataclasses.replace(cfg, name="m")
    assert load_config(path) == got_cfg
    assert set(got) == set(weights)
    for key, tensor in weights.items():
        assert got[key].dtype == torch.bfloat16 and torch.equal(got[key], tensor), key


@pytest.mark.parametrize("qtype", [getattr(Q, t) for t in SUPPORTED_TYPES if t != "F32"],
                         ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_quantized_gguf_matches_transformers_loader(tmp_path, name: str, qtype: Q,
                                                   make_hf_config) -> None:
    cfg = _wide(name)
    path = write_gguf(tmp_path / "m.gguf", cfg, random_weights(cfg, seed=7), qtype=qtype,
                      rope_freqs=cfg.rope_scaling is not None)
    _, got = load_checkpoint(path)
    want = _transformers_weights(path, cfg, make_hf_config)
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor.to(torch.bfloat16)), key
    if qtype not in K_QUANTS:  # real quantization of our weights: close to them
        w = random_weights(cfg, seed=7)["model.layers.0.self_attn.q_proj.weight"].float()
        err = (got["model.layers.0.self_attn.q_proj.weight"].float() - w).norm() / w.norm()
        assert err < 0.2, f"{qtype.name}: relative error {err:.3f}"


def test_unpermute_inverts_llama_cpp_permute() -> None:
    gen = torch.Generator().manual_seed(0)
    for heads, rows in ((4, 256), (2, 128), (9, 576)):
        w = torch.randn(rows, 8, generator=gen)
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_qk(permuted, heads), w)


def test_llama3_scaling_comes_from_rope_freqs(tmp_path) -> None:
    cfg = get_preset("tiny-llama")
    weights = random_weights(cfg, seed=1)
    plain = load_config(write_gguf(tmp_path / "plain.gguf", cfg, weights))
    assert plain.rope_scaling is None  # no rope_freqs tensor: plain RoPE
    scaled = load_config(write_gguf(tmp_path / "scaled.gguf", cfg, weights, rope_freqs=True))
    assert scaled.rope_scaling == cfg.rope_scaling
    odd = np.linspace(1, 3, cfg.head_dim // 2, dtype=np.float32)
    path = write_gguf(tmp_path / "odd.gguf", cfg, weights,
                      extra_tensors={"rope_freqs.weight": odd})
    with pytest.raises(UnsupportedError, match="rope_freqs") as e:
        load_config(path)
    _one_line_error(e, path)


def test_folder_with_one_gguf(tmp_path) -> None:
    cfg = get_preset("tiny-qwen3")
    write_gguf(tmp_path / "a.gguf", cfg, random_weights(cfg, seed=2))
    assert find_gguf(tmp_path) == tmp_path / "a.gguf"
    assert load_config(tmp_path).hidden_size == cfg.hidden_size
    write_gguf(tmp_path / "b.gguf", cfg, random_weights(cfg, seed=2))
    with pytest.raises(CheckpointError, match="2 GGUF files"):
        load_checkpoint(tmp_path)


def _tiny_gguf(tmp_path: Path, **kwargs) -> Path:
    cfg = kwargs.pop("cfg", get_preset("tiny-qwen3"))
    return write_gguf(tmp_path / "m.gguf", cfg, random_weights(cfg, seed=3), **kwargs)


@pytest.mark.parametrize("damage", ["truncated", "header-only", "empty", "garbage"])
def test_damaged_gguf_is_one_line_naming_the_file(tmp_path, damage: str) -> None:
    path = _tiny_gguf(tmp_path)
    data = path.read_bytes()
    cut = {"truncated": data[: len(data) * 2 // 3], "header-only": data[:200], "empty": b"",
           "garbage": bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8))}
    path.write_bytes(cut[damage])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    _one_line_error(e, path)


def test_unsupported_gguf_contents(tmp_path) -> None:
    cases = {
        "architecture 'gpt2'": dict(arch="gpt2"),
        "type Q5_K": dict(cfg=_wide("tiny-qwen3"), qtype=Q.Q5_K),
        "unexpected tensors": dict(extra_tensors={"blk.0.attn_q.bias": np.zeros(256, np.float32)}),
        "NaN": dict(nan=True),
    }
    for i, (match, kwargs) in enumerate(cases.items()):
        folder = tmp_path / str(i)
        folder.mkdir()
        if kwargs.pop("nan", False):
            cfg = get_preset("tiny-qwen3")
            weights = random_weights(cfg, seed=3)
            weights["model.norm.weight"][3] = float("nan")
            path = write_gguf(folder / "m.gguf", cfg, weights)
        else:
            path = _tiny_gguf(folder, **kwargs)
        with pytest.raises(MpkError, match=match) as e:
            load_checkpoint(path)
        _one_line_error(e, path)


def test_cli_names_a_bad_gguf_and_exits_2(tmp_path, capsys) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(100))
    code = main(["generate", "--checkpoint", str(path), "--backend", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(path) in err, err


def _tokenizer_gguf(tmp_path: Path, pre: str = "smollm") -> Path:
    tok = byte_level_tokenizer(pre)
    tok["add_bos_token"] = pre == "llama-bpe"  # as Llama 3 files say: BOS before every text
    cfg = dataclasses.replace(get_preset("tiny-llama"), vocab_size=len(tok["token_list"]))
    return write_gguf(tmp_path / "tok.gguf", cfg, random_weights(cfg, seed=4), tokenizer=tok,
                      rope_freqs=True)


TEXTS = ["The capital of France is", "the cap it al", "<|im_start|>user\nhi<|im_end|>\n",
         "Ünïcödé 12345  spaces\n\n\ttabs", "don't", "THE'S  \n\n the", ""]


@pytest.mark.parametrize("pre", ["smollm", "qwen2", "llama-bpe", "default"])
def test_tokenizer_and_chat_template_match_transformers(tmp_path, pre: str) -> None:
    """Per llama.cpp pre-tokenizer type (SmolLM2, Qwen3, Llama 3, GPT-2 style splits)."""
    transformers = pytest.importorskip("transformers")
    path = _tokenizer_gguf(tmp_path, pre)
    ours = load_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
    assert ours.encode(" the capital").ids != ours.encode(" the cap ital").ids  # merges apply
    assert (ours.encode("the").ids[0] == 1) == (pre == "llama-bpe")  # add_bos_token honoured
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    template = load_chat_template(path)
    text = template.render(messages)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode(text, add_special_tokens=False).ids[:1] == [1]  # <|im_start|> kept whole


def test_unknown_pre_tokenizer_is_refused(tmp_path) -> None:
    path = _tokenizer_gguf(tmp_path, pre="made-up")
    with pytest.raises(UnsupportedError, match="pre-tokenizer 'made-up'"):
        load_tokenizer(path)
    assert load_config(path).vocab_size > 256  # the model itself still loads
