"""The endpoints: /v1/completions and /v1/chat/completions (whole or streamed as server-sent
events in OpenAI's chunk format), /v1/models, /health, /metrics."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from mpk.engine.requests import (FinishReason, InvalidRequestError, RequestHandle, RequestResult,
                                 SamplingParams, positions_needed)
from mpk.engine.serving import EngineStoppedError
from mpk.errors import MpkError
from mpk.server.errors import ApiError, error_payload
from mpk.server.protocol import (DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest,
                                 CompletionRequest, SamplingFields)
from mpk.server.state import ServerState
from mpk.server.text import IncrementalText
from mpk.server.tokens import TokenStream, cancel_on_disconnect

log = logging.getLogger(__name__)

CLIENT_GONE = "cancelled(client-disconnected)"  # in the request's log line
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop")


@dataclass(frozen=True)
class _Kind:
    """What differs between the two generation endpoints' responses."""

    chat: bool
    id_prefix: str
    object: str
    chunk_object: str


COMPLETION = _Kind(False, "cmpl-", "text_completion", "text_completion")
CHAT = _Kind(True, "chatcmpl-", "chat.completion", "chat.completion.chunk")


def make_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if state.engine_error is not None:
            return JSONResponse({"status": "error", "error": state.engine_error}, status_code=503)
        return JSONResponse({"status": "ok", "model": state.model_name})

    @router.get("/metrics")
    def metrics() -> Response:
        return Response(state.metrics.render(), media_type=state.metrics.CONTENT_TYPE)

    @router.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @router.get("/v1/models/{model_id:path}")
    def model(model_id: str) -> dict[str, Any]:
        _check_model(state, model_id)
        return _model_card(state)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        body.refuse_unsupported()
        _check_model(state, body.model)
        prompt = body.single_prompt()
        ids = state.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        _check_length(state, len(ids), max_tokens, "prompt", "max_tokens")
        return await _generate(state, request, COMPLETION, body, ids, max_tokens)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        body.refuse_unsupported()
        _check_model(state, body.model)
        ids = state.codec.encode_chat(body.template_messages())
        given = body.requested_max_tokens
        # OpenAI's chat default is "as long as the context allows".
        max_tokens = given if given is not None else max(1, state.max_seq_len - len(ids) + 1)
        param = "max_completion_tokens" if body.max_completion_tokens is not None else \
            "max_tokens"
        _check_length(state, len(ids), max_tokens, "messages", param)
        return await _generate(state, request, CHAT, body, ids, max_tokens)

    return router


# ---- checks ----------------------------------------------------------------------------------
def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "mpk", "max_model_len": state.max_seq_len}


def _check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                            f"{state.model_name!r}", param="model", code="model_not_found")


def _check_length(state: ServerState, prompt_len: int, max_tokens: int, prompt_param: str,
                  max_param: str) -> None:
    limit = state.max_seq_len
    if prompt_len > limit:
        raise ApiError(400, f"this model's maximum context length is {limit} tokens, but the "
                            f"{prompt_param} has {prompt_len} tokens; shorten it",
                       param=prompt_param, code="context_length_exceeded")
    if isinstance(max_tokens, int) and max_tokens > 0 and \
            positions_needed(prompt_len, max_tokens) > limit:
        raise ApiError(400, f"{max_param}={max_tokens} is too large: with a {prompt_len}-token "
                            f"{prompt_param} the {limit}-token context leaves room for at most "
                            f"{limit - prompt_len + 1} tokens", param=max_param,
                       code="invalid_value")


def _params(state: ServerState, body: SamplingFields, max_tokens: int) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, state.eos_token_ids)
    except InvalidRequestError as e:
        raise _bad_request(e) from None


def _bad_request(e: InvalidRequestError) -> ApiError:
    # The engine's messages start with the parameter they are about ("temperature 0.7: ...",
    # "max_tokens must be ..."): name it as OpenAI's `param`.
    message = str(e)
    param = next((f for f in _SAMPLING_FIELDS if message.startswith(f)), None)
    if param is None and message.startswith("prompt"):
        param = "prompt"
    return ApiError(400, message, param=param, code="invalid_value")


def _submit(state: ServerState, ids: list[int], params: SamplingParams) -> RequestHandle:
    if state.draining:
        raise _shutting_down()
    try:
        return state.engine.submit(ids, params)
    except InvalidRequestError as e:
        raise _bad_request(e) from None
    except EngineStoppedError as e:
        if state.draining or "shutting down" in str(e):
            raise _shutting_down() from None
        state.engine_error = str(e)
        raise ApiError(503, f"the engine is not running: {e}") from None
    except MpkError as e:  # stopped between the drain check and here
        raise ApiError(503, f"the engine is not running: {e}") from None


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down and takes no new requests; retry on "
                         "another instance", code="shutting_down", headers={"Connection": "close"})


# ---- generation ------------------------------------------------------------------------------
async def _generate(state: ServerState, request: Request, kind: _Kind, body: SamplingFields,
                    ids: list[int], max_tokens: int) -> Response:
    params = _params(state, body, max_tokens)
    handle = _submit(state, ids, params)
    info: dict[str, Any] = request.state.info  # the request's log line (app.py)
    info.update(engine_id=handle.id, prompt_tokens=len(ids))
    tokens = TokenStream(handle, on_finish=lambda result: _finished(state, result, len(ids)),
                         on_token=state.metrics.tokens_generated)
    response_id = kind.id_prefix + info["request_id"]
    if body.stream:
        events = _events(state, kind, body, tokens, ids, response_id, info)
        return _EngineStream(events, handle, info, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    async with cancel_on_disconnect(request.receive, handle) as disconnect:
        async for _ in tokens:
            pass
    result = handle.result()
    if disconnect.happened:  # nobody reads the answer; 499 (nginx's) tells the log why
        info.update(completion_tokens=len(result.token_ids), finish=CLIENT_GONE)
        return Response(status_code=499)
    _raise_if_failed(state, result)
    text = _final_text(state, result)
    info.update(completion_tokens=len(result.token_ids), finish=result.finish_reason.value)
    choice: dict[str, Any] = {"index": 0, "logprobs": None,
                              "finish_reason": result.finish_reason.value}
    if kind.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return JSONResponse({"id": response_id, "object": kind.object, "created": int(time.time()),
                         "model": state.model_name, "choices": [choice],
                         "usage": _usage(len(ids), result)})


def _finished(state: ServerState, result: RequestResult, prompt_tokens: int) -> None:
    state.metrics.request_finished(result, prompt_tokens)
    if result.finish_reason is FinishReason.ERROR and state.engine_error is None:
        state.engine_error = result.error or "the engine failed"


def _raise_if_failed(state: ServerState, result: RequestResult) -> None:
    if result.finish_reason is FinishReason.ERROR:
        raise ApiError(500, f"the engine failed while running this request: {result.error}")
    if result.finish_reason is FinishReason.CANCELLED:  # not by this client: it is listening
        raise ApiError(503, "the request was cancelled: the server is shutting down",
                       code="shutting_down")


def _final_text(state: ServerState, result: RequestResult) -> str:
    return result.text if result.text is not None else state.codec.decode(result.token_ids)


def _usage(prompt_tokens: int, result: RequestResult) -> dict[str, int]:
    n = len(result.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n,
            "total_tokens": prompt_tokens + n}


async def _events(state: ServerState, kind: _Kind, body: SamplingFields, tokens: TokenStream,
                  ids: list[int], response_id: str, info: dict[str, Any]) -> AsyncIterator[str]:
    """The SSE stream: a chunk per piece of text that can no longer change, the finish chunk,
    the usage chunk when asked for, [DONE]. An engine failure becomes an error event."""
    created = int(time.time())

    def chunk(piece: str, finish: str | None = None, role: bool = False) -> str:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if kind.chat:  # the first delta names the role, the last one is empty
            choice["delta"] = ({"role": "assistant", "content": ""} if role else
                               {} if finish is not None else {"content": piece})
        else:
            choice["text"] = piece
        return _sse({"id": response_id, "object": kind.chunk_object, "created": created,
                     "model": state.model_name, "choices": [choice]})

    text = IncrementalText(state.codec.decode, body.stop_strings())
    try:
        if kind.chat:
            yield chunk("", role=True)  # the role comes first, as OpenAI sends it
        async for token in tokens:
            piece = text.push(token)
            if piece:
                yield chunk(piece)
        result = tokens.handle.result()
        info.update(completion_tokens=len(result.token_ids), finish=result.finish_reason.value)
        _raise_if_failed(state, result)
        tail = text.finish(_final_text(state, result))
        if tail:
            yield chunk(tail)
        yield chunk("", result.finish_reason.value)
        if body.include_usage:
            yield _sse({"id": response_id, "object": kind.chunk_object, "created": created,
                        "model": state.model_name, "choices": [],
                        "usage": _usage(len(ids), result)})
        yield "data: [DONE]\n\n"
    except ApiError as e:
        yield _sse(e.payload())
    except Exception:  # the headers are out: the error travels as an event, the trace to the log
        log.exception("streaming failed")
        yield _sse(error_payload(500, f"internal server error (request id "
                                      f"{info['request_id']})"))


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _EngineStream(StreamingResponse):
    """A streamed generation whose engine request is cancelled however the response ends (a
    client disconnect cancels the send task), so its slot and pages never outlive the client."""

    def __init__(self, content: AsyncIterator[str], handle: RequestHandle, info: dict[str, Any],
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.handle = handle
        self.info = info

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.handle.done:
                self.handle.cancel()
                self.info["finish"] = CLIENT_GONE
