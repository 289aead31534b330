"""From what a user names (a preset or a checkpoint path) to what a command runs: the config,
where real weights come from, and the text side (tokenizer, chat template) when there is one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from mpk.models.chat import ChatTemplate, load_chat_template
from mpk.models.config import ModelConfig, get_preset, load_config
from mpk.models.download import REMOTE_MODELS, fetch_model
from mpk.models.weights import load_tokenizer


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: `checkpoint` is None for a preset run with random weights."""

    cfg: ModelConfig
    label: str  # how to name the model in output
    checkpoint: str | None = None
    tokenizer: Tokenizer | None = None
    chat_template: ChatTemplate | None = None

    @property
    def random_weights(self) -> bool:
        return self.checkpoint is None


def resolve_model(preset: str | None = None, checkpoint: str | Path | None = None,
                  progress: bool | None = None) -> ResolvedModel:
    """The model of `--model PRESET` or `--checkpoint PATH` (exactly one is given).

    A preset with real weights (REMOTE_MODELS, e.g. smollm2-135m) is fetched into the cache on
    first use and then behaves like its checkpoint; other presets get random weights."""
    if (preset is None) == (checkpoint is None):
        raise ValueError("give exactly one of preset and checkpoint")
    if preset is not None and preset not in REMOTE_MODELS:
        return ResolvedModel(get_preset(preset), preset)
    if preset is not None:
        get_preset(preset)  # the preset's shapes exist even before the download
        checkpoint = fetch_model(preset, progress=progress)
    path = str(checkpoint)
    cfg = load_config(path)
    return ResolvedModel(cfg, preset or cfg.name or path, path, load_tokenizer(path),
                         load_chat_template(path))
