"""The text side of serving: prompts to token ids, and token ids to streamed text.

Streaming must never send a character it may have to take back, because a client cannot un-see
it. Two things can change the end of a decoded text when the next token arrives:
- a character whose UTF-8 bytes are split across tokens decodes to U+FFFD until its last byte
  comes, so a trailing U+FFFD is held back;
- text that may be the beginning of a stop string: if the stop string completes, the request's
  text ends before it, so the longest suffix that begins some stop string is held back.
Everything held back is sent (or dropped, for a stop string) when the request ends, from the
engine's final text, so the streamed pieces always add up to the non-streamed text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import Tokenizer

from mpk.models.chat import ChatTemplate
from mpk.server.errors import ApiError

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"  # what a byte-level decoder writes for an incomplete UTF-8 sequence


def ids_as_text(ids: Sequence[int]) -> str:
    """The text of a model without a tokenizer (random-weight presets): each id as ' <id>', so
    clients still see one piece per token and can parse the ids back."""
    return "".join(f" {int(i)}" for i in ids)


class TextCodec:
    """A served model's tokenizer and chat template (either may be missing)."""

    def __init__(self, tokenizer: Tokenizer | None, chat_template: ChatTemplate | None,
                 model_name: str) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_name = model_name

    @property
    def detokenize(self) -> Callable[[list[int]], str] | None:
        """What the engine uses for stop strings and final texts (None without a tokenizer)."""
        return self.tokenizer.decode if self.tokenizer is not None else None

    def decode(self, ids: Sequence[int]) -> str:
        """Output text; special tokens (an end-of-turn id) are left out, as OpenAI does."""
        if self.tokenizer is None:
            return ids_as_text(ids)
        return self.tokenizer.decode(list(ids))

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """A completion prompt's ids (the tokenizer adds BOS when the model wants one)."""
        return self._tokenizer(param).encode(text).ids

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The chat template rendered for `messages`, ready for the assistant's turn."""
        tokenizer = self._tokenizer("messages")
        if self.chat_template is None:
            raise ApiError(400, f"model {self.model_name!r} has no chat template: use "
                                f"/v1/completions", param="messages")
        from mpk.errors import CheckpointError

        try:
            text = self.chat_template.render(messages)
        except CheckpointError as e:  # e.g. the template's raise_exception on a role order
            raise ApiError(400, str(e), param="messages") from None
        # The template writes the special tokens itself: none added on top.
        return tokenizer.encode(text, add_special_tokens=False).ids

    def _tokenizer(self, param: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ApiError(400, f"model {self.model_name!r} has no tokenizer (random-weight "
                                f"presets have none): send the prompt as an array of token ids "
                                f"to /v1/completions", param=param)
        return self.tokenizer


def stable_prefix(text: str, stop: Sequence[str]) -> str:
    """The part of `text` that no later token can change or cut away (see the module doc)."""
    text = text.rstrip(REPLACEMENT)
    cuts = [text.find(s) for s in stop if s in text]
    if cuts:
        return text[: min(cuts)]
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return text[: len(text) - hold]


class IncrementalText:
    """A request's text, piece by piece as its tokens arrive. push() returns what may be sent
    now; finish() the rest, given the engine's final text."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        self._ids.append(token)
        # The whole output is decoded again (not only the new token): a token's text depends on
        # its neighbours (split characters, decoders that trim spaces at the start).
        safe = stable_prefix(self._decode(self._ids), self._stop)
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, final_text: str) -> str:
        if not final_text.startswith(self.sent):
            # Only a decoder whose earlier text changes with later tokens gets here (none of
            # the byte-level tokenizers MPK loads); what was sent cannot be taken back.
            log.warning("streamed text %r is not a prefix of the final text %r", self.sent,
                        final_text)
            return ""
        delta, self.sent = final_text[len(self.sent):], final_text
        return delta
