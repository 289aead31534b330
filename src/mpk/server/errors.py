"""Errors in OpenAI's schema: {"error": {"message", "type", "param", "code"}} with the status
OpenAI uses, so the official clients raise their usual exceptions (BadRequestError, ...).

Messages say what was wrong and what is allowed; they never carry a traceback (those go to the
server's log, under the request id).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# OpenAI's error types by status (4xx: the request; 5xx: the server).
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """A request the server answers with an error (status, OpenAI's type / param / code)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def payload(self) -> dict[str, Any]:
        return error_payload(self.status, self.message, self.param, self.code)


def error_payload(status: int, message: str, param: str | None = None,
                  code: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """A 400 for pydantic's errors of a request body (FastAPI's RequestValidationError)."""
    if not errors:
        return ApiError(400, "invalid request body")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, "the request body is not valid JSON; send a JSON object with "
                             "Content-Type: application/json", code="invalid_json")
    if not loc:  # the body as a whole: missing, or an array / string instead of an object
        return ApiError(400, "the request body must be a JSON object, sent with Content-Type: "
                             "application/json", code="invalid_json")
    # Union members appear in loc as type names ("prompt", "str"): the field is the first entry
    # that is not one, and an int is a list index.
    field = _field_path(loc)
    param = field.split("[")[0].split(".")[0]
    if kind == "missing":
        return ApiError(400, f"missing required parameter: '{field}'", param=param,
                        code="missing_required_parameter")
    if kind == "extra_forbidden":
        return ApiError(400, f"unrecognized request argument supplied: '{field}'", param=param,
                        code="unknown_parameter")
    # A field of several accepted shapes fails once per shape; pydantic's first message would
    # name only one of them.
    expected = _EXPECTED.get(field.split(".")[-1].split("[")[0])
    why = f"expected {expected}" if expected else first.get("msg", "invalid")
    return ApiError(400, f"invalid value for '{field}': {why} (got "
                         f"{_short(first.get('input'))})", param=param, code="invalid_type")


_EXPECTED = {
    "prompt": "a string, an array of token ids, or a one-element array of either",
    "stop": "a string or an array of strings",
    "content": "a string or an array of {'type': 'text', 'text': ...} parts",
}


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "list[str]", "list[int]",
               "list[list[int]]", "list[ContentPart]", "function-after", "constrained-int"}


def _field_path(loc: Sequence[str]) -> str:
    out = ""
    for part in loc:
        if part.isdigit():
            out += f"[{part}]"
        elif part in _TYPE_NAMES or "[" in part:
            continue
        else:
            out += ("." if out else "") + part
    return out or loc[0]


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
