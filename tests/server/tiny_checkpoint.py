"""A tiny random-weight model as a Hugging Face checkpoint folder with a byte-level tokenizer and
a chat template, so the server's text paths (prompts as text, chat, stop strings, streamed
UTF-8) run in milliseconds per step instead of SmolLM2's ~200 ms.

tiny-llama's vocabulary is 256 ids: token i is byte i (GPT-2's byte-to-character table, the
same byte-level decoder real Llama 3 / Qwen3 / SmolLM tokenizers use). Its random weights emit
arbitrary bytes, so outputs are full of multi-byte characters split across tokens and invalid
sequences: exactly what streaming has to get right.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from mpk.models import get_preset, random_weights, save_checkpoint

PRESET = "tiny-llama"
SEED = 1234
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: each byte as a printable character (the byte-level BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer() -> Tokenizer:
    """Token i = byte i; no merges, no special tokens."""
    vocab = {char: b for b, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_tiny_checkpoint(folder: Path) -> Path:
    cfg = get_preset(PRESET)
    assert cfg.vocab_size == 256, "the byte tokenizer needs exactly 256 ids"
    save_checkpoint(folder, cfg, random_weights(cfg, seed=SEED))
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return folder
