"""The tokenizer a GGUF file describes, rebuilt as a `tokenizers.Tokenizer`.

A GGUF has no tokenizer.json: it stores llama.cpp's view of the tokenizer (model type, the
pre-tokenizer's name, tokens, merges, token types, special ids). For byte-level BPE files
(`tokenizer.ggml.model == "gpt2"`, which covers SmolLM, Llama 3 and Qwen3) we rebuild the same
pipeline llama.cpp runs: the pre-tokenizer's split regex, byte-level BPE over the file's merges,
control tokens kept whole. Other tokenizer types and unknown pre-tokenizers are refused rather
than approximated, since a wrong split gives plausible but wrong ids.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from mpk.errors import UnsupportedError
from mpk.models.gguf import GGUFFile

# Split regexes of llama.cpp's pre-tokenizer types (llama-vocab.cpp), as HF spells them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(split: str | None = None, digits: bool = False) -> pre_tokenizers.PreTokenizer:
    """Byte-level pre-tokenization: GPT-2's regex unless `split` replaces it; `digits` first
    cuts every digit apart (llama.cpp's "smollm": its regex list starts with \\p{N})."""
    steps: list[pre_tokenizers.PreTokenizer] = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split is not None:
        steps.append(pre_tokenizers.Split(Regex(split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None))
    return pre_tokenizers.Sequence(steps)


#: tokenizer.ggml.pre -> (pre-tokenizer factory, BPE ignore_merges). llama.cpp's Llama 3
#: tokenizer looks whole words up in the vocabulary before merging (ignore_merges).
_PRE_TOKENIZERS = {
    "default": (lambda: _byte_level(), False),
    "gpt-2": (lambda: _byte_level(), False),
    "smollm": (lambda: _byte_level(digits=True), False),
    "llama3": (lambda: _byte_level(_LLAMA3_SPLIT), True),
    "llama-bpe": (lambda: _byte_level(_LLAMA3_SPLIT), True),
    "qwen2": (lambda: _byte_level(_QWEN2_SPLIT), False),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def gguf_tokenizer(f: GGUFFile) -> Tokenizer | None:
    """The file's tokenizer, or None when it carries no vocabulary."""
    tokens = f.get("tokenizer.ggml.tokens")
    if not tokens:
        return None
    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedError(f"{f.path}: tokenizer type {kind!r} is not supported (only "
                               f"byte-level BPE, tokenizer.ggml.model 'gpt2')")
    pre = f.get("tokenizer.ggml.pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise UnsupportedError(f"{f.path}: pre-tokenizer {pre!r} is not supported; supported: "
                               f"{sorted(_PRE_TOKENIZERS)}")
    make_pre, ignore_merges = _PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges") or ()]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges,
                               fuse_unk=False))
    tok.pre_tokenizer = make_pre()
    tok.decoder = decoders.ByteLevel()
    types = f.get("tokenizer.ggml.token_type") or ()
    # Control tokens (<|im_start|>, <|endoftext|>) and user-defined ones (<think>) are matched
    # whole in the text, as llama.cpp does; without this they would be cut into bytes.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, kind in zip(tokens, types) if kind == _CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    bos = f.get("tokenizer.ggml.bos_token_id")
    if f.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], int(bos))])
    return tok


def special_token(f: GGUFFile, which: str) -> str | None:
    """The text of the file's `which` ("bos" / "eos") token, for chat templates."""
    tokens = f.get("tokenizer.ggml.tokens") or []
    index = f.get(f"tokenizer.ggml.{which}_token_id")
    return tokens[index] if index is not None and 0 <= index < len(tokens) else None
