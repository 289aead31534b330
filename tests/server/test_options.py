"""`mpk serve` options, in-process: the API key from the environment when --api-key is absent."""

from __future__ import annotations

import pytest

from mpk.cli import build_parser
from mpk.server.options import options_from_args


def _options(monkeypatch: pytest.MonkeyPatch, key: str | None, *argv: str):
    if key is None:
        monkeypatch.delenv("MPK_API_KEY", raising=False)
    else:
        monkeypatch.setenv("MPK_API_KEY", key)
    args = build_parser().parse_args(["serve", "--model", "tiny-llama", *argv])
    return options_from_args(args, "cpu")


def test_the_api_key_comes_from_the_flag_or_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _options(monkeypatch, None).api_key is None
    assert _options(monkeypatch, "").api_key is None  # empty: no key
    assert _options(monkeypatch, "env-key").api_key == "env-key"
    assert _options(monkeypatch, "env-key", "--api-key", "flag").api_key == "flag"
    assert _options(monkeypatch, None, "--weights-seed", "7").weights_seed == 7


def test_prefill_rows_reach_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _options(monkeypatch, None).prefill_rows is None  # the engine's default
    assert _options(monkeypatch, None, "--prefill-rows", "1").prefill_rows == 1
    assert _options(monkeypatch, None).prefill_chunk == 256
    assert _options(monkeypatch, None, "--prefill-chunk", "0").prefill_chunk == 0
