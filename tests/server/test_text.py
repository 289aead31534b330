"""Streamed text in-process: a character split across tokens is sent whole, text that may begin a
stop string is held back, and the pieces always add up to the final text."""

from __future__ import annotations

import random

import pytest

from mpk.server.text import IncrementalText, ids_as_text, stable_prefix
from tests.server.tiny_checkpoint import byte_tokenizer

TOK = byte_tokenizer()


def pieces(text: str, stop: tuple[str, ...] = ()) -> list[str]:
    """What IncrementalText sends for `text` fed byte by byte (one token per byte)."""
    inc = IncrementalText(TOK.decode, stop)
    return [inc.push(b) for b in text.encode()]


def test_multibyte_characters_are_sent_whole() -> None:
    text = "a€b😀"  # 3- and 4-byte characters
    got = pieces(text)
    assert got == ["a", "", "", "€", "b", "", "", "", "😀"]
    assert all("\ufffd" not in p for p in got)


def test_stop_string_start_is_held_back() -> None:
    got = pieces("xxSTOxSTOP!", stop=("STOP",))
    assert "".join(got) == "xxSTOx"  # 'STO' went out once 'x' showed it was not a stop
    assert got[2:5] == ["", "", ""]
    assert stable_prefix("abcST", ("STOP", "TX")) == "abc"
    assert stable_prefix("abc\ufffd", ("STOP",)) == "abc"
    assert stable_prefix("abPcSTOP", ("STOP", "P")) == "ab"  # the earliest stop wins


@pytest.mark.parametrize("seed", range(5))
def test_pieces_add_up_to_the_final_text(seed: int) -> None:
    """Random bytes (invalid UTF-8 included) and random stop strings: whatever was sent is a
    prefix of the engine's final text, and finish() sends the rest."""
    rng = random.Random(seed)
    ids = [rng.randrange(256) for _ in range(200)]
    full = TOK.decode(ids)
    stop = tuple(full[i: i + rng.randint(1, 3)] for i in rng.sample(range(len(full) - 3), 2))
    stop = tuple(s for s in stop if s)
    inc = IncrementalText(TOK.decode, stop)
    sent = ""
    for i, token in enumerate(ids):
        sent += inc.push(token)
        text = TOK.decode(ids[: i + 1])
        cut = min([text.find(s) for s in stop if s in text], default=None)
        final = text if cut is None else text[:cut]
        assert final.startswith(sent)
        if cut is not None:
            break
    assert sent + inc.finish(final) == final


def test_finish_of_a_model_without_tokenizer() -> None:
    inc = IncrementalText(ids_as_text)
    assert [inc.push(t) for t in (5, 17)] == [" 5", " 17"]
    assert inc.finish(ids_as_text([5, 17])) == ""
