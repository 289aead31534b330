"""`mpk serve` as a real process on a loopback port, for tests: started with --port 0 (the
address comes from its one stdout line), its stderr log kept line by line so tests can wait for
a line (an event, not a sleep), stopped by its pid."""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_S = 300.0  # load + compile on a busy 2-core CI machine
REQUEST_TIMEOUT_S = 120.0


class ServerProcess:
    def __init__(self, args: Sequence[str], api_key: str | None = None) -> None:
        self.api_key = api_key
        cmd = [sys.executable, "-m", "mpk", "serve", "--backend", "cpu", "--host", "127.0.0.1",
               "--port", "0", *args]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        self._log_lock = threading.Condition()
        self._stdout: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        line = self._stdout.get(timeout=START_TIMEOUT_S)
        if line is None or "http://" not in line:
            self.stop()
            raise RuntimeError(f"mpk serve did not start: {line!r}\n" + "".join(self.log))
        self.base_url = line.split(" on ", 1)[1].split()[0]  # http://127.0.0.1:PORT/v1
        host_port = self.base_url.split("//", 1)[1].split("/", 1)[0]
        self.host, self.port = host_port.rsplit(":", 1)[0], int(host_port.rsplit(":", 1)[1])

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._stdout.put(line)
        self._stdout.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._log_lock:
                self.log.append(line)
                self._log_lock.notify_all()

    # ---- clients -----------------------------------------------------------------------------
    def client(self, api_key: str | None = None, **kwargs: Any) -> openai.OpenAI:
        options = {"max_retries": 0, "timeout": REQUEST_TIMEOUT_S, **kwargs}
        return openai.OpenAI(base_url=self.base_url, api_key=api_key or self.api_key or "none",
                             **options)

    def raw(self, method: str, path: str, body: bytes | str | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
        """One plain HTTP request (for what the openai client cannot send: bad JSON, no key)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return (response.status, {k.lower(): v for k, v in response.getheaders()},
                    response.read().decode())
        finally:
            conn.close()

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post_json(self, path: str, payload: Any) -> tuple[int, dict[str, Any]]:
        status, _, text = self.raw("POST", path, json.dumps(payload),
                                   {"Content-Type": "application/json", **self.auth()})
        return status, json.loads(text)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name plus labels, e.g. 'mpk_requests_total{finish_reason
        =length}'."""
        status, _, text = self.raw("GET", "/metrics")
        assert status == 200, text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_for_metrics(self, predicate: Any, timeout: float = 60.0) -> dict[str, float]:
        """Poll /metrics until predicate(metrics) holds (the server's state lives in another
        process: there is no event to wait on)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if predicate(m):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics never matched: {m}")
            time.sleep(0.05)

    # ---- the log and the process ----------------------------------------------------------------
    def wait_for_log(self, text: str, timeout: float = 60.0, after: int = 0) -> str:
        """The first log line from line `after` on that contains `text` (waits for it)."""
        deadline = time.monotonic() + timeout
        with self._log_lock:
            while True:
                hit = next((line for line in self.log[after:] if text in line), None)
                if hit is not None:
                    return hit
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no log line with {text!r}:\n" + "".join(self.log))
                self._log_lock.wait(min(left, 1.0))

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
