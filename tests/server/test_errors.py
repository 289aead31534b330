"""Every bad request gets OpenAI's error schema with the right status (so the openai client raises
its usual exception), names the offending parameter, and carries no traceback."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import API_KEY, MAX_SEQ_LEN, MODEL
from tests.server.server_process import ServerProcess


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in exc.response.text
    return body["error"]


BAD_COMPLETIONS = [  # (extra arguments, param the error names)
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 500}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"stop": 5}, "stop"),
    ({"seed": -1}, "seed"),
    ({"n": 2}, "n"),
    ({"logprobs": 3}, "logprobs"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"extra_body": {"not_a_parameter": 1}}, "not_a_parameter"),
]


@pytest.mark.parametrize("extra,param", BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_parameter_is_400(server: ServerProcess, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL, prompt="hi", **extra)
    err = error_of(info.value)
    assert info.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param, err


def test_bad_chat_messages_are_400(server: ServerProcess) -> None:
    client = server.client()
    for messages, param in (([{"role": "robot", "content": "hi"}], "messages"),
                            ([{"role": "user", "content": 5}], "messages"),
                            ([{"role": "user", "content": [{"type": "image_url",
                                                            "image_url": {"url": "x"}}]}],
                             "messages"),
                            ([], "messages")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages)
        assert error_of(info.value)["param"] == param


def test_unknown_model_is_404(server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        server.client().completions.create(model="gpt-4", prompt="hi", max_tokens=1)
    err = error_of(info.value)
    assert err["code"] == "model_not_found" and "gpt-4" in err["message"]
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("gpt-4")


def test_prompt_longer_than_the_context_is_400(server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL, prompt="x" * (MAX_SEQ_LEN + 1),
                                           max_tokens=1)
    err = error_of(info.value)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x" * MAX_SEQ_LEN}])
    assert error_of(info.value)["code"] == "context_length_exceeded"


def test_max_tokens_too_large_is_400(server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL, prompt="0123456789",
                                           max_tokens=MAX_SEQ_LEN)
    err = error_of(info.value)
    assert err["param"] == "max_tokens" and f"at most {MAX_SEQ_LEN - 9}" in err["message"]
    # The exact limit fits: 10 prompt tokens + 503 new ones write 512 positions.
    ok = server.client().completions.create(model=MODEL, prompt="0123456789", max_tokens=0)
    assert ok.choices[0].text == "" and ok.choices[0].finish_reason == "length"


def test_bad_prompts_are_400(server: ServerProcess) -> None:
    client = server.client()
    for prompt in ("", [], [256], [-1], ["a", "b"]):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        assert error_of(info.value)["param"] == "prompt", prompt


def test_malformed_json_is_400(server: ServerProcess) -> None:
    for body in ('{"model": "tiny", "prompt": ', "[1, 2]", "null", ""):
        status, headers, text = server.raw("POST", "/v1/completions", body,
                                           {"Content-Type": "application/json", **server.auth()})
        assert status == 400, (body, text)
        err = json.loads(text)["error"]
        assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
        assert headers["x-request-id"]


def test_api_key(server: ServerProcess) -> None:
    payload = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1})
    json_type = {"Content-Type": "application/json"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, _, text = server.raw("POST", "/v1/completions", payload, {**json_type, **headers})
        assert status == 401, text
        assert json.loads(text)["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    # Operations endpoints stay open.
    assert server.raw("GET", "/health")[0] == 200 and server.raw("GET", "/metrics")[0] == 200


def test_unknown_path_and_method(server: ServerProcess) -> None:
    status, _, text = server.raw("GET", "/v1/engines", headers=server.auth())
    assert status == 404 and json.loads(text)["error"]["message"]
    status, _, text = server.raw("GET", "/v1/completions", headers=server.auth())
    assert status == 405 and json.loads(text)["error"]["type"] == "invalid_request_error"
