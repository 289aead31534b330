"""Weights under their Hugging Face names: the expected shapes, random weights for tests and
benchmarks, and the safetensors checkpoint loader.

Everything downstream (builder, reference model) takes a flat {HF name: bf16 tensor} dict, so a
real checkpoint and a random model of the same config are interchangeable.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError
from tokenizers import Tokenizer
from tqdm import tqdm

from mpk.errors import CheckpointError
from mpk.models.config import ModelConfig, load_config

#: Keys some checkpoints carry that hold no weights we need (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{Hugging Face tensor name: shape} for every weight the model uses, in layer order.

    lm_head.weight appears only when the embeddings are untied; q/k norms only for Qwen3 (and
    Qwen3-MoE). A MoE layer has the router `mlp.gate.weight` [E, H] and each expert's
    `mlp.experts.{e}.{gate,up,down}_proj.weight` (the names checkpoints and transformers'
    save_pretrained use) instead of the dense MLP."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if cfg.is_moe_layer(i):
            shapes.update(_expert_shapes(cfg, p + "mlp."))
            continue
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _expert_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (cfg.num_experts, h)}
    for e in range(cfg.num_experts):
        shapes[p + f"experts.{e}.gate_proj.weight"] = (inter, h)
        shapes[p + f"experts.{e}.up_proj.weight"] = (inter, h)
        shapes[p + f"experts.{e}.down_proj.weight"] = (h, inter)
    return shapes


def random_weights(cfg: ModelConfig, seed: int,
                   device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Seeded random bf16 weights that keep a deep model numerically sane.

    2-D weights (linears, embedding, lm_head) ~ N(0, 1/in_features): each projection maps
    unit-RMS inputs to unit-RMS outputs, so the residual stream grows only like sqrt(layers) and
    logits have std ~1 with top-1/top-2 margins of ~0.1-0.5. The embedding gets the same
    1/sqrt(hidden) scale as real checkpoints do: with std 1 a TIED model's logits are dominated
    by the input token's own row and greedy decoding just repeats it. Norm weights
    ~ 1 + 0.1 N(0, 1) (near the identity but not trivially so). Each tensor is drawn from its
    own generator seeded by (seed, name) on `device`, so the result does not depend on the
    order of generation (values differ between CPU and CUDA for the same seed) and 8B models
    generate in seconds on a GPU. MoE experts are views into one stacked buffer per layer and
    projection (_expert_views)."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    slots = _expert_views(cfg, device)
    out: dict[str, torch.Tensor] = {}
    for name, shape in hf_weight_shapes(cfg).items():
        gen.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63))
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
        if len(shape) == 1:
            t.mul_(0.1).add_(1.0)
        else:
            t.mul_(1.0 / math.sqrt(shape[1]))
        if name in slots:
            t = slots[name].copy_(t)
        out[name] = t
    return out


def _expert_views(cfg: ModelConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """{HF name of an expert weight: its view} into two buffers per MoE layer, laid out as the
    graph stacks them (models/moe.py): [E, 2, I, H] (each expert's gate then up projection) and
    [E, H, I] (the down projections). graph_weights then takes the buffers as they are instead
    of stacking a second copy: qwen3-30b-a3b's 61 GB fit one H200 once, not twice."""
    h, inter, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    views: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_layers):
        if not cfg.is_moe_layer(layer):
            continue
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = torch.empty((n, 2, inter, h), device=device, dtype=torch.bfloat16)
        down = torch.empty((n, h, inter), device=device, dtype=torch.bfloat16)
        for e in range(n):
            views[f"{p}{e}.gate_proj.weight"] = gate_up[e, 0]
            views[f"{p}{e}.up_proj.weight"] = gate_up[e, 1]
            views[f"{p}{e}.down_proj.weight"] = down[e]
    return views


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], where: str = "") -> None:
    """Raise CheckpointError unless `weights` holds exactly the expected names and shapes."""
    where = f" in {where}" if where else ""
    expected = hf_weight_shapes(cfg)
    for name, shape in expected.items():
        if name not in weights:
            raise CheckpointError(f"tensor {name} {list(shape)} is missing{where}")
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(f"tensor {name}{where} has shape {list(weights[name].shape)}, "
                                  f"expected {list(shape)} for {cfg.name or cfg.arch}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise CheckpointError(f"unexpected tensors{where}: {extra[:5]}"
                              f"{' ...' if len(extra) > 5 else ''}")


def load_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a local Hugging Face checkpoint folder: config.json plus model.safetensors or a
    sharded model.safetensors.index.json. Returns the config and bf16 weights under HF names.

    Every expected tensor must be present with the right shape; unexpected tensors are an error
    (they would mean a feature we would silently ignore, e.g. biases), except recomputed
    buffers such as rotary inv_freq and a tied model's redundant lm_head.weight."""
    from mpk.models.gguf import find_gguf, load_gguf

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return load_gguf(gguf_file)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is neither a folder nor a .gguf file")
    cfg = load_config(path)
    shards = _shard_files(path)
    weights: dict[str, torch.Tensor] = {}
    for shard in tqdm(shards, desc=f"loading {path.name}", unit="shard", disable=None):
        try:
            _load_shard(shard, cfg, weights)
        except (SafetensorError, OSError) as e:
            # An empty, cut or foreign file: say which file, not only where the parser stopped.
            raise CheckpointError(f"{shard} is not a readable safetensors file (empty, "
                                  f"truncated or corrupt): {e}") from None
    expected = hf_weight_shapes(cfg)
    missing = [n for n in expected if n not in weights]
    if missing:
        raise CheckpointError(f"tensor {missing[0]} {list(expected[missing[0]])} is missing from "
                              f"{path} ({len(missing)} missing in all; files: "
                              f"{[s.name for s in shards]})")
    return cfg, weights


def _load_shard(shard: Path, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Add one safetensors file's tensors to `weights` (checked against cfg's names, shapes)."""
    from safetensors import safe_open

    expected = hf_weight_shapes(cfg)
    with safe_open(str(shard), framework="pt", device="cpu") as f:
        for name in f.keys():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and cfg.tie_embeddings:
                continue  # tied: the embedding is the lm_head
            if name not in expected:
                raise CheckpointError(f"unexpected tensor {name} in {shard} (not part of a "
                                      f"{cfg.arch} model with this config.json)")
            shape = tuple(f.get_slice(name).get_shape())
            if shape != expected[name]:
                raise CheckpointError(f"tensor {name} in {shard} has shape {list(shape)}, "
                                      f"expected {list(expected[name])} from config.json")
            tensor = f.get_tensor(name)
            if not tensor.is_floating_point():
                raise CheckpointError(f"tensor {name} in {shard} has dtype {tensor.dtype}; "
                                      "expected a float type")
            weights[name] = tensor.to(torch.bfloat16).contiguous()


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer in `<path>/tokenizer.json` or in a GGUF checkpoint's metadata, or None
    when the checkpoint has none."""
    from mpk.models.gguf import find_gguf, open_gguf
    from mpk.models.gguf_tokenizer import gguf_tokenizer

    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return gguf_tokenizer(open_gguf(gguf_file))
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises its own exception types
        raise CheckpointError(f"cannot read tokenizer {file}: {e}") from None


def _shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, from the index when it is sharded."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a safetensors index ({e})") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f} named in {index} does not exist")
        return files
    if single.is_file():
        return [single]
    found = sorted(p.name for p in path.iterdir())
    raise CheckpointError(f"{path} has neither model.safetensors nor "
                          f"model.safetensors.index.json (found: {found})")


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy when t is a view into a larger buffer (random_weights' experts):
    safetensors refuses to save tensors that share memory."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def save_checkpoint(path: str | Path, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                    max_shard_bytes: int | None = None) -> None:
    """Write config.json and model.safetensors (or shards + index when max_shard_bytes is set)
    in the layout load_checkpoint and transformers read: lets tests and benchmarks make a
    checkpoint of a random model without transformers."""
    from safetensors.torch import save_file

    check_weights(cfg, weights, "the weights given to save_checkpoint")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    tensors = {k: _own_storage(v.detach().to("cpu").contiguous()) for k, v in weights.items()}
    if max_shard_bytes is None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                            for t in tensors.values())},
             "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
