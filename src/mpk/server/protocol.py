"""OpenAI request bodies, validated strictly (a string where a number belongs is a 400, as
OpenAI answers, not silently converted), and their mapping to the engine's SamplingParams.

Parameters MPK cannot honour (logprobs, penalties, n > 1, tools, ...) are refused by name
rather than ignored: a client that asks for them would otherwise get a plausible, wrong answer.
Unknown parameters are refused too, as OpenAI does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from mpk.engine.requests import SamplingParams
from mpk.server.errors import ApiError

# OpenAI's default temperature is 1 (sampling). The engine decodes greedily until in-kernel
# sampling lands, so a request that does not say gets 0 (greedy); one that asks for sampling
# gets the engine's clear 400. Change this one constant when sampling is supported.
DEFAULT_TEMPERATURE = 0.0
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """Parameters shared by both endpoints; top_k and ignore_eos are extensions (vLLM's)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None  # an end-user id for abuse tracking: accepted, unused
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise ApiError(400, f"n={self.n}: only one choice per request (n=1) is supported; "
                                f"send separate requests", param="n")
        if self.presence_penalty or self.frequency_penalty:
            which = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise ApiError(400, f"{which} is not supported (only 0)", param=which)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true",
                           param="stream_options")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_params(self, max_tokens: int, eos_token_ids: tuple[int, ...]) -> SamplingParams:
        """The engine's parameters (SamplingParams validates ranges: InvalidRequestError)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_k=0 if self.top_k in (None, -1) else self.top_k,  # -1: vLLM's "no limit"
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop_token_ids=() if self.ignore_eos else eos_token_ids,
            stop=self.stop_strings())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    # A text, a list of token ids, or a one-element list of either (OpenAI's batch form).
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for name in ("echo", "suffix"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported", param=name)
        if self.logprobs is not None:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of is not supported (only 1)", param="best_of")

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"{len(prompt)} prompts in one request: only one prompt "
                                    f"per request is supported", param="prompt")
            return prompt[0]  # type: ignore[return-value]
        return prompt  # type: ignore[return-value]


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not self.messages:
            raise ApiError(400, "messages is empty: send at least one message",
                           param="messages")
        if self.logprobs or self.top_logprobs is not None:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                raise ApiError(400, f"{name}: tool calls are not supported", param=name)
        if self.response_format not in (None, {"type": "text"}):
            raise ApiError(400, "response_format: only {'type': 'text'} is supported",
                           param="response_format")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ApiError(400, "give max_tokens or max_completion_tokens, not both",
                           param="max_completion_tokens")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_input() for m in self.messages]
