"""Model descriptions: configs and presets, Hugging Face weights, RoPE, the PyTorch reference.

The graph builder (builder.py) turns a ModelConfig plus HF-named weights into a Graph.
"""

from mpk.models.config import PRESETS, ModelConfig, get_preset, load_config
from mpk.models.weights import (hf_weight_shapes, load_checkpoint, load_tokenizer,
                                random_weights, save_checkpoint)

__all__ = ["PRESETS", "ModelConfig", "get_preset", "load_config", "hf_weight_shapes",
           "load_checkpoint", "load_tokenizer", "random_weights", "save_checkpoint"]
