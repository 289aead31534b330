"""`mpk serve` through the official openai client: completions and chat equal the engine's greedy
output, streamed chunks add up to the non-streamed text, stop strings, usage, models, health,
metrics, request ids."""

from __future__ import annotations

import re

from tests.server.conftest import MAX_BATCH, MODEL, Oracle
from tests.server.server_process import ServerProcess
from tests.server.tiny_checkpoint import CHAT_TEMPLATE, byte_tokenizer

PROMPT = "The capital of France is"


def stream_texts(stream) -> tuple[list[str], list[object]]:
    """The text pieces of a completion stream and every chunk."""
    chunks = list(stream)
    return [c.choices[0].text for c in chunks if c.choices and c.choices[0].text], chunks


def test_completion_equals_the_engine(server: ServerProcess, oracle: Oracle) -> None:
    out = server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=12)
    choice = out.choices[0]
    assert choice.text == oracle.text(PROMPT, 12)
    assert choice.finish_reason == "length" and out.model == MODEL
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    n_prompt = len(byte_tokenizer().encode(PROMPT).ids)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
        (n_prompt, 12, n_prompt + 12)


def test_default_max_tokens_is_16(server: ServerProcess) -> None:
    out = server.client().completions.create(model=MODEL, prompt="x")
    assert out.usage.completion_tokens == 16


def test_token_id_prompt_equals_text_prompt(server: ServerProcess) -> None:
    client = server.client()
    ids = byte_tokenizer().encode(PROMPT).ids
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6)
    one_of_batch = client.completions.create(model=MODEL, prompt=[ids], max_tokens=6)
    assert by_text.choices[0].text == by_ids.choices[0].text == one_of_batch.choices[0].text


def test_chat_completion_applies_the_template(server: ServerProcess, oracle: Oracle) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    out = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    rendered = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
    assert "{% for m in messages %}" in CHAT_TEMPLATE  # the rendering above is this template's
    assert out.choices[0].message.content == oracle.text(rendered, 10)
    assert out.choices[0].message.role == "assistant" and out.object == "chat.completion"
    assert out.usage.prompt_tokens == len(rendered.encode())  # one token per byte


def test_streamed_completion_equals_non_streamed(server: ServerProcess) -> None:
    """40 random-weight tokens: bytes that split multi-byte characters across tokens."""
    client = server.client()
    whole = client.completions.create(model=MODEL, prompt="Stream me", max_tokens=40)
    pieces, chunks = stream_texts(client.completions.create(
        model=MODEL, prompt="Stream me", max_tokens=40, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(pieces) == whole.choices[0].text
    assert len(pieces) > 5  # really streamed, not one piece at the end
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_equals_non_streamed(server: ServerProcess) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


def _stop_candidate(text: str) -> tuple[str, int]:
    """A 3-character piece of `text` (no U+FFFD) whose first occurrence is at index >= 4."""
    for i in range(4, len(text) - 3):
        piece = text[i: i + 3]
        if "\ufffd" not in piece and text.find(piece) == i:
            return piece, i
    raise AssertionError(f"no stop string candidate in {text!r}")


def test_stop_string_cuts_streamed_and_whole(server: ServerProcess) -> None:
    client = server.client()
    full = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=40)
    stop, at = _stop_candidate(full.choices[0].text)
    whole = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=40,
                                      stop=[stop, "\x00never"])
    assert whole.choices[0].text == full.choices[0].text[:at]
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < 40
    pieces, chunks = stream_texts(client.completions.create(
        model=MODEL, prompt="Stop here", max_tokens=40, stop=stop, stream=True))
    # Streamed text is never taken back: the pieces add up to the cut text exactly, so no
    # piece ever carried the stop string's start.
    assert "".join(pieces) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sampling_is_reproducible_per_seed(server: ServerProcess, oracle: Oracle) -> None:
    client = server.client()

    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                         temperature=1.5, seed=seed).choices[0].text

    assert sample(7) == sample(7)
    greedy = oracle.text(PROMPT, 12)
    assert {sample(s) for s in (1, 2, 3)} != {greedy}  # sampled, not the greedy text
    # top_k and top_p reach the engine: keeping only the likeliest token is greedy again.
    for narrow in ({"extra_body": {"top_k": 1}}, {"top_p": 1e-6}):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                        temperature=1.5, seed=1, **narrow)
        assert out.choices[0].text == greedy, narrow


def test_models_health_and_request_id(server: ServerProcess) -> None:
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    status, headers, body = server.raw("GET", "/health")
    assert status == 200 and '"ok"' in body
    status, headers, body = server.raw("POST", "/v1/completions",
                                       f'{{"model": "{MODEL}", "prompt": "id", "max_tokens": 2}}',
                                       {"Content-Type": "application/json", **server.auth()})
    request_id = headers["x-request-id"]
    assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", request_id)
    assert f'"cmpl-{request_id}"' in body.replace(" ", "")
    line = server.wait_for_log(f"[{request_id}]")
    assert "POST /v1/completions 200" in line and "completion_tokens=2" in line


def test_metrics(server: ServerProcess) -> None:
    server.client().completions.create(model=MODEL, prompt="metrics", max_tokens=5)
    m = server.metrics()
    assert m["mpk_requests_total{finish_reason=length}"] >= 1
    assert m["mpk_time_to_first_token_seconds_count"] >= 1
    assert m["mpk_inter_token_latency_seconds_count"] >= 4
    assert m["mpk_generation_tokens_total"] >= 5
    assert m["mpk_kv_pages_total"] > 0 and m["mpk_batch_slots"] == MAX_BATCH
    for name in ("mpk_requests_running", "mpk_requests_waiting", "mpk_kv_pages_used",
                 "mpk_generation_tokens_per_second"):
        assert name in m
