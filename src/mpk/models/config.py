"""ModelConfig: the shape of a decoder LLM (Qwen3, Llama 3, or Qwen3-MoE), read from a Hugging Face
config.json or taken from a preset.

The builder, the weight loader, the reference model and the engine all key off this one frozen
record, so it is validated once here (a bad config fails at load time, not deep in the compiler).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpk.errors import CheckpointError, UnsupportedError

#: model_type in config.json -> our arch name.
SUPPORTED_MODEL_TYPES: dict[str, str] = {"qwen3": "qwen3", "llama": "llama",
                                         "qwen3_moe": "qwen3_moe"}
#: architectures[0] in config.json -> arch, used when model_type is absent.
_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
                  "Qwen3MoeForCausalLM": "qwen3_moe"}
_CLASS_OF_ARCH = {arch: cls for cls, arch in _ARCHITECTURES.items()}
#: Archs with q/k RMSNorm (Qwen3 and its MoE variant always, Llama never).
_QK_NORM_ARCHS = ("qwen3", "qwen3_moe")
#: rope_type values rope.py implements (None / "default" means plain RoPE).
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

RopeScaling = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of one model. Frozen and hashable so it can key caches."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position: int
    tie_embeddings: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    name: str = ""
    # Mixture of experts (arch "qwen3_moe"; all zero / empty for dense models). A layer i is
    # sparse when i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0, as in
    # transformers' Qwen3MoeDecoderLayer; the other layers keep a dense MLP of
    # intermediate_size (is_moe_layer).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        who = f"model config {self.name!r}" if self.name else "model config"
        if self.arch not in SUPPORTED_MODEL_TYPES.values():
            raise UnsupportedError(f"{who}: arch {self.arch!r} is not supported; "
                                   f"supported: {sorted(set(SUPPORTED_MODEL_TYPES.values()))}")
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim", "max_position"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UnsupportedError(f"{who}: {field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedError(f"{who}: num_heads {self.num_heads} is not a multiple of "
                                   f"num_kv_heads {self.num_kv_heads} (GQA needs whole groups)")
        if self.head_dim % 2:
            raise UnsupportedError(f"{who}: head_dim {self.head_dim} must be even for RoPE")
        if not self.rms_eps > 0 or not self.rope_theta > 0:
            raise UnsupportedError(f"{who}: rms_eps ({self.rms_eps}) and rope_theta "
                                   f"({self.rope_theta}) must be positive")
        if self.qk_norm != (self.arch in _QK_NORM_ARCHS):
            raise UnsupportedError(f"{who}: qk_norm={self.qk_norm} does not match arch "
                                   f"{self.arch!r} (Qwen3 always has q/k norm, Llama never)")
        if not all(isinstance(t, int) for t in self.eos_token_ids):
            raise UnsupportedError(f"{who}: eos_token_ids must be ints, got {self.eos_token_ids}")
        if self.rope_scaling is not None:
            _check_rope_scaling(dict(self.rope_scaling), who)
        _check_moe(self, who)

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        """rope_scaling as the dict Hugging Face uses (None for plain RoPE)."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Does layer `layer` route through experts (else: a dense MLP)? transformers' rule."""
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def expert_params(self) -> int:
        """Parameters of one expert (its gate, up and down projections); 0 for dense models."""
        return 3 * self.hidden_size * self.moe_intermediate_size if self.is_moe else 0

    @property
    def num_params(self) -> int:
        """Parameter count including embeddings (counted once when tied) and norms."""
        return self._params(active=False)

    @property
    def active_params(self) -> int:
        """Parameters one decode step of one row reads: num_params with only the
        num_experts_per_tok chosen experts of each MoE layer (the router is read whole). Equal
        to num_params for dense models."""
        return self._params(active=True)

    def _params(self, active: bool) -> int:
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * q + 2 * h * kv + q * h + (2 * d if self.qk_norm else 0)
        dense = 3 * h * self.intermediate_size
        experts = self.num_experts_per_tok if active else self.num_experts
        sparse = self.num_experts * h + experts * self.expert_params
        mlps = sum(sparse if self.is_moe_layer(i) else dense for i in range(self.num_layers))
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return embed + self.num_layers * (attn + 2 * h) + mlps + h

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights in bf16."""
        return 2 * self.num_params

    @classmethod
    def from_hf(cls, d: dict[str, Any], name: str = "") -> ModelConfig:
        """Read a Qwen3ForCausalLM / LlamaForCausalLM / Qwen3MoeForCausalLM config.json dict.

        Accepts both the transformers 4.x layout (rope_theta + rope_scaling) and the 5.x one
        (rope_parameters holding rope_theta and the scaling keys)."""
        who = f"config {name!r}" if name else "config"
        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        if model_type is None and archs:
            model_type = _ARCHITECTURES.get(archs[0])
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedError(f"{who}: model_type {d.get('model_type')!r} (architectures "
                                   f"{archs}) is not supported; supported: "
                                   f"{sorted(SUPPORTED_MODEL_TYPES)}")
        arch = SUPPORTED_MODEL_TYPES[model_type]
        # Both fields must agree: a GPT-2 checkpoint labelled model_type "llama" would load
        # its tensors by llama's names and run as a different model.
        foreign = [a for a in archs if _ARCHITECTURES.get(a) != arch]
        if foreign:
            raise UnsupportedError(f"{who}: architectures {archs} do not match model_type "
                                   f"{model_type!r}; MPK runs {sorted(_ARCHITECTURES)}")
        _reject_unsupported_features(d, who)
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            kv_heads = int(d.get("num_key_value_heads") or heads)
            head_dim = int(d.get("head_dim") or hidden // heads)
            theta, scaling = _rope_from_hf(d)
            eos = d.get("eos_token_id")
            eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list)
                                                                     else [eos]))
            bos = d.get("bos_token_id")
            return cls(
                arch=arch, vocab_size=int(d["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]), num_heads=heads, num_kv_heads=kv_heads,
                head_dim=head_dim, rms_eps=float(d["rms_norm_eps"]), rope_theta=theta,
                rope_scaling=scaling, max_position=int(d["max_position_embeddings"]),
                tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                qk_norm=arch in _QK_NORM_ARCHS,
                bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids, name=name,
                **(_moe_from_hf(d) if arch == "qwen3_moe" else {}))
        except KeyError as e:
            raise CheckpointError(f"{who}: config.json lacks the key {e.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """A config.json-style dict (4.x layout: rope_theta + rope_scaling) that
        transformers' Qwen3Config / LlamaConfig accept and from_hf reads back."""
        d: dict[str, Any] = {
            "model_type": self.arch,
            "architectures": [_CLASS_OF_ARCH[self.arch]],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling_dict,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings, "hidden_act": "silu",
            "attention_bias": False, "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else
                             (self.eos_token_ids[0] if self.eos_token_ids else None)),
        }
        if self.arch == "llama":
            d["mlp_bias"] = False
        if self.is_moe:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers))
        return d


def load_config(path: str | Path) -> ModelConfig:
    """Read `<path>/config.json` (or the file itself) into a ModelConfig named after the folder;
    a .gguf file (or a folder holding one and no config.json) is read from its metadata."""
    from mpk.models.gguf import find_gguf, gguf_config, open_gguf

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return gguf_config(open_gguf(gguf_file))
    file = path if path.is_file() else path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path} has no config.json (and no .gguf file)")
    try:
        d = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{file} is not a config.json (a JSON object)")
    try:
        return ModelConfig.from_hf(d, name=file.parent.name)
    except (CheckpointError, UnsupportedError) as e:  # name the file the user has to fix
        raise type(e)(f"{file}: {e}") from None


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, rope_scaling) from either config layout."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling: dict[str, Any] | None = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling")
    if not scaling:
        return theta, None
    scaling = dict(scaling)
    if "type" in scaling:  # the old spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type"}:
        return theta, None
    return theta, tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                               for k, v in scaling.items()))


def _check_rope_scaling(scaling: dict[str, Any], who: str) -> None:
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedError(f"{who}: rope_scaling type {rope_type!r} is not supported; "
                               f"supported: {list(SUPPORTED_ROPE_TYPES)} (scaling: {scaling})")
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in scaling]
        if missing:
            raise UnsupportedError(f"{who}: llama3 rope_scaling lacks {missing}: {scaling}")
        if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise UnsupportedError(f"{who}: llama3 rope_scaling needs high_freq_factor > "
                                   f"low_freq_factor: {scaling}")


def _moe_from_hf(d: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a qwen3_moe config.json (a missing key raises KeyError, which from_hf
    reports as a CheckpointError). transformers 5.x writes num_experts as num_local_experts."""
    experts = d["num_experts"] if "num_experts" in d else d["num_local_experts"]
    return {"num_experts": int(experts), "num_experts_per_tok": int(d["num_experts_per_tok"]),
            "moe_intermediate_size": int(d["moe_intermediate_size"]),
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(d.get("decoder_sparse_step", 1)),
            # transformers only tests membership: duplicates and order mean nothing
            "mlp_only_layers": tuple(sorted({int(i) for i in d.get("mlp_only_layers") or []}))}


def _check_moe(cfg: ModelConfig, who: str) -> None:
    if cfg.arch != "qwen3_moe":
        if (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                cfg.norm_topk_prob, cfg.decoder_sparse_step, cfg.mlp_only_layers) != \
                (0, 0, 0, False, 1, ()):
            raise UnsupportedError(f"{who}: the mixture-of-experts fields are only for arch "
                                   f"'qwen3_moe', not {cfg.arch!r}")
        return
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "decoder_sparse_step"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UnsupportedError(f"{who}: {field} must be a positive int for a mixture of "
                                   f"experts, got {value!r}")
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise UnsupportedError(f"{who}: num_experts_per_tok {cfg.num_experts_per_tok} exceeds "
                               f"num_experts {cfg.num_experts}")
    if not isinstance(cfg.norm_topk_prob, bool):
        raise UnsupportedError(f"{who}: norm_topk_prob must be a bool, got "
                               f"{cfg.norm_topk_prob!r}")
    only = cfg.mlp_only_layers
    if not isinstance(only, tuple) or only != tuple(sorted(set(only))) or \
            not all(isinstance(i, int) and 0 <= i < cfg.num_layers for i in only):
        raise UnsupportedError(f"{who}: mlp_only_layers must be a sorted tuple of distinct layer "
                               f"indices in [0, {cfg.num_layers}), got {only!r}")


def _reject_unsupported_features(d: dict[str, Any], who: str) -> None:
    """Fail on config features the megakernel does not implement rather than compute wrongly."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedError(f"{who}: hidden_act {act!r} is not supported (only 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise UnsupportedError(f"{who}: {key}=true is not supported (bias-free linears only)")
    if d.get("use_sliding_window"):
        raise UnsupportedError(f"{who}: use_sliding_window=true is not supported")
    layer_types = d.get("layer_types") or []
    odd = sorted({t for t in layer_types if t != "full_attention"})
    if odd:
        raise UnsupportedError(f"{who}: layer_types {odd} are not supported "
                               "(only 'full_attention')")
    if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedError(f"{who}: partial_rotary_factor != 1 is not supported")


def _llama3(factor: float) -> RopeScaling:
    return tuple(sorted({"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}.items()))


def _qwen3(name: str, hidden: int, inter: int, layers: int, heads: int, tied: bool,
           vocab: int = 151936, kv: int = 8, head_dim: int = 128, bos: int | None = 151643,
           eos: tuple[int, ...] = (151645,), max_pos: int = 40960) -> ModelConfig:
    return ModelConfig(arch="qwen3", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=inter, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv, head_dim=head_dim, rms_eps=1e-6, rope_theta=1e6,
                       rope_scaling=None, max_position=max_pos, tie_embeddings=tied,
                       qk_norm=True, bos_token_id=bos, eos_token_ids=eos, name=name)


def _qwen3_moe(name: str, hidden: int, inter: int, layers: int, heads: int, kv: int,
               experts: int, top_k: int, moe_inter: int, norm_topk: bool, vocab: int = 151936,
               head_dim: int = 128, bos: int | None = 151643, eos: tuple[int, ...] = (151645,),
               max_pos: int = 40960, mlp_only: tuple[int, ...] = ()) -> ModelConfig:
    return ModelConfig(arch="qwen3_moe", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=inter, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv, head_dim=head_dim, rms_eps=1e-6, rope_theta=1e6,
                       rope_scaling=None, max_position=max_pos, tie_embeddings=False,
                       qk_norm=True, bos_token_id=bos, eos_token_ids=eos, name=name,
                       num_experts=experts, num_experts_per_tok=top_k,
                       moe_intermediate_size=moe_inter, norm_topk_prob=norm_topk,
                       mlp_only_layers=mlp_only)


def _llama(name: str, hidden: int, inter: int, layers: int, heads: int, head_dim: int,
           tied: bool, factor: float, vocab: int = 128256, kv: int = 8,
           bos: int | None = 128000, eos: tuple[int, ...] = (128001,)) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=inter, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv, head_dim=head_dim, rms_eps=1e-5, rope_theta=500000.0,
                       rope_scaling=_llama3(factor), max_position=131072, tie_embeddings=tied,
                       qk_norm=False, bos_token_id=bos, eos_token_ids=eos, name=name)


#: Real shapes of the supported checkpoints (base models' bos/eos), plus tiny test models.
PRESETS: dict[str, ModelConfig] = {c.name: c for c in (
    _qwen3("qwen3-0.6b", 1024, 3072, 28, 16, tied=True),
    _qwen3("qwen3-1.7b", 2048, 6144, 28, 16, tied=True),
    _qwen3("qwen3-8b", 4096, 12288, 36, 32, tied=False),
    _llama("llama-3.2-1b", 2048, 8192, 16, 32, head_dim=64, tied=True, factor=32.0),
    _llama("llama-3.1-8b", 4096, 14336, 32, 32, head_dim=128, tied=False, factor=8.0),
    # SmolLM2-135M-Instruct: `mpk generate` runs its real weights (models/download.py).
    ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_eps=1e-5,
                rope_theta=100000.0, rope_scaling=None, max_position=8192, tie_embeddings=True,
                qk_norm=False, bos_token_id=1, eos_token_ids=(2,), name="smollm2-135m"),
    # Qwen3-30B-A3B: 30.5B parameters, 3.3B of them read per token (8 of 128 experts).
    _qwen3_moe("qwen3-30b-a3b", 2048, 6144, 48, 32, kv=4, experts=128, top_k=8, moe_inter=768,
               norm_topk=True),
    _qwen3("tiny-qwen3", 64, 128, 2, 4, tied=True, vocab=256, kv=2, head_dim=64, bos=None,
           eos=(), max_pos=4096),
    # 6 experts, top-2, a dense middle layer: every MoE/dense transition in 3 layers.
    _qwen3_moe("tiny-qwen3-moe", 64, 96, 3, 4, kv=2, experts=6, top_k=2, moe_inter=32,
               norm_topk=True, vocab=256, head_dim=32, bos=None, eos=(), max_pos=4096,
               mlp_only=(1,)),
    _llama("tiny-llama", 64, 160, 2, 4, head_dim=64, tied=False, factor=8.0, vocab=256, kv=2,
           bos=None, eos=()),
)}


def get_preset(name: str) -> ModelConfig:
    """The preset called `name` (see PRESETS)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UnsupportedError(f"no model preset {name!r}; presets: {sorted(PRESETS)}") from None
