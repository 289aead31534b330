"""GGUF checkpoints (llama.cpp's single-file format): the ModelConfig from the file's metadata and
the weights, dequantized to bf16, under the Hugging Face names the rest of MPK uses.

The `gguf` package (llama.cpp's own reader) parses the file and dequantizes every block format;
nothing here knows a quant layout. What this module adds: GGUF -> HF tensor names (from gguf's
TensorNameMap), undoing llama.cpp's Q/K row permutation for Llama, and one-line errors that
name the file for anything it cannot use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from mpk.errors import CheckpointError, UnsupportedError
from mpk.models.config import ModelConfig, RopeScaling

#: general.architecture -> our arch. llama.cpp's "qwen3" and "llama" match ours one to one.
ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3"}
#: Tensor types we dequantize (each covered by a test); gguf.quants does the arithmetic.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
#: llama.cpp's llama3 RoPE scaling stored as a tensor of per-frequency divisors (not a weight).
_ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class GGUFFile:
    """An opened GGUF file: its path, metadata (key -> Python value) and tensors by name."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # gguf.ReaderTensor

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise CheckpointError(f"{self.path}: GGUF metadata lacks the key {key!r}")
        return self.metadata[key]


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the path itself when it ends in .gguf, or the one .gguf in a
    folder without config.json; None when `path` is not a GGUF checkpoint (a HF folder)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        if not path.exists():
            raise CheckpointError(f"GGUF file {path} does not exist")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        raise CheckpointError(f"{path} holds {len(found)} GGUF files "
                              f"({[p.name for p in found]}); pass one of them as --checkpoint")
    return found[0] if found else None


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor table (the data stays memory-mapped).

    Parsing takes seconds (gguf reads every vocabulary string into its own array), and one
    `mpk generate` needs the config, the tokenizer, the chat template and the weights: the
    last two parses are kept, keyed by the file's identity, so a changed file is read anew."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    stat = path.stat()
    return _open(path.resolve(), stat.st_mtime_ns, stat.st_size, path)


@lru_cache(maxsize=2)
def _open(resolved: Path, mtime_ns: int, size: int, path: Path) -> GGUFFile:
    try:
        from gguf import GGUFReader
    except ImportError:  # a --no-deps install (GPU machines keep their own torch)
        raise UnsupportedError(f"reading {path} needs the gguf package: python -m pip install "
                               f"gguf") from None

    try:
        reader = GGUFReader(str(path))
        metadata = {key: _field_value(field) for key, field in reader.fields.items()
                    if not key.startswith("GGUF.")}
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OSError) as e:
        # The reader fails with numpy's words (reshape, mmap, dtype) on a cut or foreign file.
        raise CheckpointError(f"{path} is not a readable GGUF file (truncated, corrupt or not "
                              f"GGUF): {e}") from None
    return GGUFFile(path, metadata, {t.name: t for t in reader.tensors})


def gguf_config(f: GGUFFile, name: str = "") -> ModelConfig:
    """The ModelConfig a GGUF's metadata describes (named after the file unless `name`)."""
    arch_name = f.require("general.architecture")
    if arch_name not in ARCHITECTURES:
        raise UnsupportedError(f"{f.path}: GGUF architecture {arch_name!r} is not supported; "
                               f"supported: {sorted(ARCHITECTURES)}")
    arch, a = ARCHITECTURES[arch_name], f"{arch_name}."
    if f.get(a + "expert_count"):
        raise UnsupportedError(f"{f.path}: mixture-of-experts GGUFs are not supported")
    hidden = int(f.require(a + "embedding_length"))
    heads = int(f.require(a + "attention.head_count"))
    kv_heads = int(f.get(a + "attention.head_count_kv") or heads)
    head_dim = int(f.get(a + "attention.key_length") or hidden // heads)
    rope_dim = int(f.get(a + "rope.dimension_count") or head_dim)
    if rope_dim != head_dim or int(f.get(a + "attention.value_length") or head_dim) != head_dim:
        raise UnsupportedError(f"{f.path}: rope.dimension_count {rope_dim} / value_length "
                               f"differ from head_dim {head_dim} (partial RoPE is not supported)")
    embed = f.tensors.get("token_embd.weight")  # [hidden, vocab] in GGUF's axis order
    vocab = (f.get(a + "vocab_size") or len(f.get("tokenizer.ggml.tokens") or ())
             or (int(embed.shape[1]) if embed is not None else 0))
    theta = float(f.get(a + "rope.freq_base", 10000.0))
    scaling_type = f.get(a + "rope.scaling.type", "none")
    if scaling_type not in ("none", None):
        raise UnsupportedError(f"{f.path}: rope.scaling.type {scaling_type!r} is not supported")
    bos = f.get("tokenizer.ggml.bos_token_id")
    # llama.cpp stops at any end-of-generation id: eos, and eot/eom where the file has them.
    eos = [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    try:
        cfg = ModelConfig(
            arch=arch, vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(f.require(a + "feed_forward_length")),
            num_layers=int(f.require(a + "block_count")), num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim,
            rms_eps=float(f.require(a + "attention.layer_norm_rms_epsilon")),
            rope_theta=theta, rope_scaling=None,
            max_position=int(f.require(a + "context_length")),
            tie_embeddings="output.weight" not in f.tensors, qk_norm=arch == "qwen3",
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            name=name or f.path.stem)
    except UnsupportedError as e:
        raise UnsupportedError(f"{f.path}: {e}") from None
    if _ROPE_FREQS in f.tensors:
        cfg = _with_llama3_scaling(cfg, f)
    return cfg


def load_gguf(path: str | Path, name: str = "") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a GGUF checkpoint: its config and bf16 weights under Hugging Face names.

    Every expected tensor must be present with the right shape and a supported type; an
    unexpected tensor (e.g. a bias MPK would silently ignore) is an error, as for safetensors."""
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map
    from gguf.quants import dequantize

    from mpk.models.weights import hf_weight_shapes

    f = open_gguf(path)
    cfg = gguf_config(f, name)
    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == f.metadata["general.architecture"])
    names = get_tensor_name_map(arch, cfg.num_layers)
    expected = hf_weight_shapes(cfg)
    gguf_names = {names.get_name(hf, try_suffixes=(".weight",)): hf for hf in expected}
    unexpected = sorted(set(f.tensors) - set(gguf_names) - {_ROPE_FREQS})
    if unexpected:
        raise CheckpointError(f"unexpected tensors in {f.path}: {unexpected[:5]} (not part of a "
                              f"{cfg.arch} model MPK can run)")
    missing = [g for g in gguf_names if g not in f.tensors]
    if missing:
        raise CheckpointError(f"tensor {missing[0]} ({gguf_names[missing[0]]}) is missing from "
                              f"{f.path} ({len(missing)} missing in all)")
    weights: dict[str, torch.Tensor] = {}
    for gname, hf_name in tqdm(gguf_names.items(), desc=f"loading {f.path.name}",
                               unit="tensor", disable=None, leave=False):
        t = f.tensors[gname]
        qtype = GGMLQuantizationType(t.tensor_type).name
        if qtype not in SUPPORTED_TYPES:
            raise UnsupportedError(f"{f.path}: tensor {gname} has type {qtype}, which MPK does "
                                   f"not load; supported: {', '.join(SUPPORTED_TYPES)}")
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest axis first
        if shape != expected[hf_name]:
            raise CheckpointError(f"tensor {gname} in {f.path} has shape {list(shape)}, "
                                  f"expected {list(expected[hf_name])} for {hf_name}")
        try:
            values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            if not values.flags.writeable:  # an F32 tensor is a view of the read-only mmap
                values = values.copy()
            tensor = torch.from_numpy(values.reshape(shape))
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"tensor {gname} in {f.path} cannot be read as {qtype} "
                                  f"{list(shape)}: {e}") from None
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"tensor {gname} in {f.path} holds NaN or infinite values")
        if cfg.arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if hf_name.endswith("q_proj.weight") else cfg.num_kv_heads
            tensor = unpermute_qk(tensor, heads)
        weights[hf_name] = tensor.to(torch.bfloat16).contiguous()
    return cfg, weights


def unpermute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's `permute` of a Llama q/k projection.

    llama.cpp's Llama RoPE rotates adjacent pairs (x0, x1), HF's rotates halves (x_i, x_i+D/2),
    so the converter reorders each head's rows from [halves] to [interleaved]:
    reshape(heads, 2, D/2, ...).swapaxes(1, 2). The inverse reads the rows as (heads, D/2, 2)
    and swaps back."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _with_llama3_scaling(cfg: ModelConfig, f: GGUFFile) -> ModelConfig:
    """llama.cpp stores Llama 3.1+'s RoPE scaling as rope_freqs: one divisor per frequency,
    computed from (factor, low_freq_factor, high_freq_factor, original context). Recover those
    with Meta's published constants and accept them only if they reproduce the tensor."""
    import dataclasses

    from gguf.quants import dequantize

    from mpk.models.rope import inv_freq

    t = f.tensors[_ROPE_FREQS]
    divisors = torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type),
                                           dtype=np.float64)).reshape(-1)
    if divisors.numel() != cfg.head_dim // 2:
        raise CheckpointError(f"{f.path}: {_ROPE_FREQS} has {divisors.numel()} values, expected "
                              f"head_dim / 2 = {cfg.head_dim // 2}")
    if bool((divisors == 1).all()):
        return cfg
    orig = int(f.get(f"{f.metadata['general.architecture']}.rope.scaling.original_context_length")
               or 8192)
    scaling: RopeScaling = tuple(sorted({
        "rope_type": "llama3", "factor": float(divisors.max()), "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": orig}.items()))
    scaled = dataclasses.replace(cfg, rope_scaling=scaling)
    plain = dataclasses.replace(cfg, rope_scaling=None)
    # The file keeps the divisors in f32; 1e-5 relative is far tighter than any other scaling.
    if not torch.allclose(inv_freq(plain) / divisors, inv_freq(scaled), rtol=1e-5, atol=0):
        raise UnsupportedError(f"{f.path}: {_ROPE_FREQS} is not llama3 RoPE scaling with "
                               f"low/high_freq_factor 1/4 and original context {orig}")
    return scaled


def _field_value(field: Any) -> Any:
    """A metadata field as a Python value (str, int, float, bool or a list of them).

    A float32 value becomes the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06), which is what the model's config.json said before conversion."""
    from gguf import GGUFValueType

    value = field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    if field.types == [GGUFValueType.FLOAT32]:
        value = float(str(np.float32(value)))
    return value


__all__ = ["ARCHITECTURES", "SUPPORTED_TYPES", "GGUFFile", "find_gguf", "gguf_config",
           "load_gguf", "open_gguf", "unpermute_qk"]
