"""SIGTERM drains: running and queued requests finish completely, a new request gets 503 in
OpenAI's schema, then the process exits 0."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import openai
import pytest

from tests.server.conftest import MODEL
from tests.server.server_process import ServerProcess

STREAM_TOKENS = 400  # seconds of work at batch 2: still running when the probe arrives
QUEUED_TOKENS = 20


def test_sigterm_drains_then_exits_0(tiny_checkpoint: Path) -> None:
    proc = ServerProcess(["--checkpoint", str(tiny_checkpoint), "--served-model-name", MODEL,
                          "--max-batch", "2", "--max-seq-len", "512"])
    try:
        client = proc.client()
        results: dict[str, object] = {}
        streaming = [threading.Event(), threading.Event()]

        def stream(i: int) -> None:
            try:
                chunks = []
                for chunk in client.completions.create(
                        model=MODEL, prompt=f"drain {i}", max_tokens=STREAM_TOKENS, stream=True,
                        stream_options={"include_usage": True}):
                    chunks.append(chunk)
                    streaming[i].set()
                results[f"stream {i}"] = chunks
            except Exception as e:
                results[f"stream {i}"] = e
                streaming[i].set()

        def queued() -> None:
            try:
                results["queued"] = client.completions.create(model=MODEL, prompt="queued",
                                                              max_tokens=QUEUED_TOKENS)
            except Exception as e:
                results["queued"] = e

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        assert all(e.wait(timeout=120) for e in streaming), results
        threads.append(threading.Thread(target=queued))
        threads[-1].start()
        proc.wait_for_metrics(lambda m: m["mpk_requests_waiting"] == 1)  # both slots are busy

        proc.signal(signal.SIGTERM)
        proc.wait_for_log("draining")
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="too late", max_tokens=1)
        assert info.value.status_code == 503
        assert info.value.response.json()["error"]["code"] == "shutting_down"
        assert proc.raw("GET", "/health")[0] == 503

        for t in threads:
            t.join(timeout=300)
        for i in range(2):
            chunks = results[f"stream {i}"]
            assert isinstance(chunks, list), chunks
            assert chunks[-1].usage.completion_tokens == STREAM_TOKENS
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        queued_result = results["queued"]
        assert not isinstance(queued_result, Exception), queued_result
        assert queued_result.usage.completion_tokens == QUEUED_TOKENS
        assert proc.proc.wait(timeout=120) == 0
        proc.wait_for_log("drained; shutting down")
    finally:
        proc.stop()
