"""The FastAPI app: routes (routes.py) behind one ASGI middleware that gives every request an id
(the `x-request-id` header, the response's id, every log line written while it runs), checks
the API key and the drain before anything else, counts requests in flight, turns any unexpected
exception into a 500 in OpenAI's schema (the traceback goes to the log only), and writes one log
line per request.
"""

from __future__ import annotations

import contextvars
import hmac
import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mpk.server.errors import ApiError, error_payload, validation_error
from mpk.server.routes import make_router
from mpk.server.state import ServerState

log = logging.getLogger("mpk.server")

QUIET_PATHS = ("/health", "/metrics")
MAX_BODY_BYTES = 16 * 2**20  # a request body beyond this is refused (413) before it is read
_CURRENT: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "mpk_request", default=None)


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every record: the id of the request being handled, else '-'."""

    def filter(self, record: logging.LogRecord) -> bool:
        info = _CURRENT.get()
        record.request_id = info["request_id"] if info else "-"
        return True


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="mpk serve", docs_url=None, redoc_url=None)
    app.include_router(make_router(state))

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.payload(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc.errors())
        return JSONResponse(err.payload(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such endpoint: {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        return JSONResponse(error_payload(exc.status_code, message), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    app.add_middleware(RequestContext, state=state)
    return app


class RequestContext:
    """The outermost layer of every HTTP request (see the module doc)."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        info: dict[str, Any] = {"request_id": request_id}
        scope.setdefault("state", {})["info"] = info  # request.state.info in the routes
        token = _CURRENT.set(info)
        started = time.perf_counter()
        response: dict[str, Any] = {"status": 0}

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                response["status"] = message["status"]
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", request_id.encode())]
            await send(message)

        path: str = scope["path"]
        tracked = path.startswith("/v1/")
        try:
            refusal = self._refusal(scope) if tracked else None
            if refusal is not None:
                await _send_error(send_with_id, refusal)
                return
            self.state.request_started()
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                self.state.request_ended()
        except Exception:
            log.exception("unhandled error in %s %s", scope["method"], path)
            if response["status"] == 0:
                await _send_error(send_with_id, ApiError(
                    500, f"internal server error (request id {request_id})"))
        finally:
            ms = (time.perf_counter() - started) * 1e3
            extra = "".join(f" {k}={v}" for k, v in info.items() if k != "request_id")
            # Probes and scrapes come every few seconds: their successes only with -vv.
            quiet = path in QUIET_PATHS and response["status"] < 400
            log.log(logging.DEBUG if quiet else logging.INFO, "%s %s %d %.1f ms%s",
                    scope["method"], path, response["status"], ms, extra)
            _CURRENT.reset(token)

    def _refusal(self, scope: dict[str, Any]) -> ApiError | None:
        """Why a /v1 request is answered without running: API key, drain, body size."""
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        key = self.state.api_key
        if key is not None:
            auth = headers.get(b"authorization", b"")
            if not auth:
                return ApiError(401, "missing API key: send it as `Authorization: Bearer KEY`",
                                code="invalid_api_key")
            given = auth[7:] if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, key.encode()):
                return ApiError(401, "incorrect API key provided", code="invalid_api_key")
        if self.state.draining:
            return ApiError(503, "the server is shutting down and takes no new requests; "
                                 "retry on another instance", code="shutting_down",
                            headers={"Connection": "close"})
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            return ApiError(413, f"the request body has {int(length)} bytes, more than the "
                                 f"{MAX_BODY_BYTES} this server reads")
        return None


async def _send_error(send: Any, err: ApiError) -> None:
    body = json.dumps(err.payload()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
