"""The request layer in-process: an unexpected exception becomes a 500 in OpenAI's schema that
names the request id and shows no internals; the traceback goes to the log under that id."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from mpk.server.app import RequestContext, RequestIdFilter


class FakeState:
    api_key = None
    draining = False
    in_flight = 0

    def request_started(self) -> None:
        self.in_flight += 1

    def request_ended(self) -> None:
        self.in_flight -= 1


async def broken_app(scope: dict, receive: object, send: object) -> None:
    raise RuntimeError("secret internals at 0xdeadbeef")


def test_unexpected_error_is_a_clean_500(caplog: pytest.LogCaptureFixture) -> None:
    state = FakeState()
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    caplog.handler.addFilter(RequestIdFilter())
    with caplog.at_level(logging.INFO, logger="mpk.server"):
        asyncio.run(RequestContext(broken_app, state)(scope, receive, send))
    start, body = sent
    assert start["status"] == 500
    request_id = dict(start["headers"])[b"x-request-id"].decode()
    error = json.loads(body["body"])["error"]
    assert error["type"] == "server_error" and request_id in error["message"]
    assert "secret" not in body["body"].decode() and "Traceback" not in body["body"].decode()
    assert state.in_flight == 0
    failure = next(r for r in caplog.records if r.exc_info)
    assert failure.request_id == request_id and "secret internals" in caplog.text
    assert any("/v1/completions 500" in r.getMessage() and r.request_id == request_id
               for r in caplog.records)
