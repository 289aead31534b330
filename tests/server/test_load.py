"""Load and disconnects: 32 concurrent streaming clients on 8 slots lose nothing and each stream
arrives in order; a client that goes away mid-request frees its slot and pages."""

from __future__ import annotations

import threading

import openai

from tests.server.conftest import MAX_BATCH, MAX_SEQ_LEN, MODEL, Oracle
from tests.server.server_process import ServerProcess
from tests.server.tiny_checkpoint import byte_tokenizer

CLIENTS = 32
MAX_TOKENS = 8
CANCELLED = "mpk_requests_total{finish_reason=cancelled}"


def expected_pieces(ids: list[int]) -> list[str]:
    """The text pieces the server must stream for these tokens, in order."""
    from mpk.server.text import IncrementalText

    decode = byte_tokenizer().decode
    inc = IncrementalText(decode)
    out = [p for p in (inc.push(t) for t in ids) if p]
    tail = inc.finish(decode(ids))
    return out + ([tail] if tail else [])


def test_32_concurrent_streams(server: ServerProcess, oracle: Oracle) -> None:
    assert CLIENTS > MAX_BATCH  # most clients wait in the queue for a slot
    prompts = [f"Client {i} asks:" for i in range(CLIENTS)]
    tok = byte_tokenizer()
    want = [expected_pieces(ids) for ids in
            oracle.ids([tok.encode(p).ids for p in prompts], MAX_TOKENS)]
    results: list[object] = [None] * CLIENTS
    start = threading.Barrier(CLIENTS)

    def run(i: int) -> None:
        try:
            client = server.client()
            start.wait()
            stream = client.completions.create(model=MODEL, prompt=prompts[i],
                                               max_tokens=MAX_TOKENS, stream=True,
                                               stream_options={"include_usage": True})
            results[i] = list(stream)
        except Exception as e:  # reported below with the client's index
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    errors = {i: r for i, r in enumerate(results) if not isinstance(r, list)}
    assert not errors, errors
    for i, chunks in enumerate(results):
        pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
        assert pieces == want[i], f"client {i}"  # every piece, in order
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    server.wait_for_metrics(lambda m: m["mpk_requests_running"] == 0
                            and m["mpk_kv_pages_used"] == 0 and m["mpk_requests_waiting"] == 0)


def test_disconnect_mid_stream_frees_slot_and_pages(server: ServerProcess) -> None:
    before, mark = server.metrics(), len(server.log)
    max_tokens = MAX_SEQ_LEN - 20  # seconds of work: it must be cut short, not finish
    stream = server.client().completions.create(model=MODEL, prompt="Disconnect me",
                                                max_tokens=max_tokens, stream=True)
    chunks = iter(stream)
    got = [next(chunks) for _ in range(3)]
    assert all(c.choices[0].finish_reason is None for c in got)
    running = server.metrics()
    assert running["mpk_requests_running"] >= 1 and running["mpk_kv_pages_used"] > 0
    stream.close()  # the client goes away
    after = server.wait_for_metrics(
        lambda m: m.get(CANCELLED, 0) == before.get(CANCELLED, 0) + 1
        and m["mpk_requests_running"] == 0 and m["mpk_kv_pages_used"] == 0)
    generated = after["mpk_generation_tokens_total"] - before["mpk_generation_tokens_total"]
    assert 3 <= generated < max_tokens
    line = server.wait_for_log("finish=cancelled(client-disconnected)", after=mark)
    assert "POST /v1/completions 200" in line  # the stream had started


def test_disconnect_while_waiting_for_a_whole_completion(server: ServerProcess) -> None:
    """A non-streamed request whose client gives up (timeout) is cancelled too."""
    before, mark = server.metrics(), len(server.log)
    client = server.client(timeout=1.0)
    try:
        client.completions.create(model=MODEL, prompt="Wait for me", max_tokens=MAX_SEQ_LEN - 20)
        raise AssertionError("hundreds of tokens on the CPU interpreter took less than 1 s")
    except openai.APITimeoutError:
        pass
    server.wait_for_metrics(
        lambda m: m.get(CANCELLED, 0) == before.get(CANCELLED, 0) + 1
        and m["mpk_requests_running"] == 0 and m["mpk_kv_pages_used"] == 0)
    line = server.wait_for_log("finish=cancelled(client-disconnected)", after=mark)
    assert "POST /v1/completions 499" in line
