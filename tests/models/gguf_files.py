"""Writing small GGUF files the way llama.cpp's convert_hf_to_gguf.py does, for the GGUF tests.

Only the `gguf` package's writer is used; the one piece of converter logic copied here is its
Llama q/k `permute` (the forward direction, so the loader's inverse is checked against it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from mpk.models.config import ModelConfig
from mpk.models.rope import inv_freq

#: Types gguf.quants can quantize; the K-quants are written as random blocks (see _k_blocks).
QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)
K_QUANTS = (Q.Q4_K, Q.Q6_K)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> llama.cpp pairs)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _k_blocks(rows: int, cols: int, qtype: Q, seed: int) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantize these; the tests compare dequantizers).
    Every byte is < 0x3C, so each f16 scale inside a block is finite and below 1 whatever the
    layout: no NaN, no overflow."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    gen = np.random.default_rng(seed)
    return gen.integers(0, 0x3C, (rows, cols // block * size), dtype=np.uint8)


def write_gguf(path: Path, cfg: ModelConfig, weights: dict[str, torch.Tensor],
               qtype: Q = Q.F32, arch: str | None = None, tokenizer: dict | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None, rope_freqs: bool = False,
               seed: int = 0) -> Path:
    """A GGUF of cfg + HF-named weights: 2-D weights in `qtype`, norms in F32 (as llama.cpp
    keeps them), Llama q/k permuted, llama3 scaling as a rope_freqs tensor when asked."""
    arch = arch or cfg.arch
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_vocab_size(cfg.vocab_size)
    for key, value in (tokenizer or {}).items():
        getattr(writer, f"add_{key}")(value)
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == cfg.arch), cfg.num_layers)
    for i, (hf_name, tensor) in enumerate(weights.items()):
        if hf_name == "lm_head.weight" and cfg.tie_embeddings:
            continue
        w = tensor.float().numpy()
        if cfg.arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            w = llama_cpp_permute(w, cfg.num_heads if "q_proj" in hf_name else cfg.num_kv_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        if w.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(name, w.astype(np.float32))
        elif qtype not in QUANTIZABLE:  # K-quants (and Q5_K for the error test)
            writer.add_tensor(name, _k_blocks(*w.shape, qtype, seed + i), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    if rope_freqs:
        plain = inv_freq(dataclasses.replace(cfg, rope_scaling=None))
        writer.add_tensor("rope_freqs.weight",
                          (plain / inv_freq(cfg)).numpy().astype(np.float32))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def byte_level_tokenizer(pre: str = "smollm") -> dict:
    """A small byte-level BPE vocabulary in GGUF form (GGUFWriter method suffix -> value): the
    256 byte symbols, a few merges, and chat control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "Ġ c", "a p", "Ġc ap", "i t", "a l", "Ġcap it", "Ġcapit al"]
    tokens = symbols + [m.replace(" ", "") for m in merges]
    control = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = control + tokens
    types = [3] * len(control) + [1] * (len(tokens) - len(control))
    return {"tokenizer_model": "gpt2", "tokenizer_pre": pre, "token_list": tokens,
            "token_types": types, "token_merges": merges, "bos_token_id": 1, "eos_token_id": 2,
            "add_bos_token": False,
            "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                             "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"}
