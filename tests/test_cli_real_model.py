"""`mpk generate` on the real SmolLM2-135M preset: the README's command, --chat, and a GGUF
given as --checkpoint."""

from __future__ import annotations

import json

import pytest

from mpk.cli import main
from mpk.models.chat import load_chat_template
from mpk.models.weights import load_tokenizer
from tests.real_model import smollm2_gguf

pytestmark = pytest.mark.slow


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_readme_command_says_paris(capsys: pytest.CaptureFixture[str]) -> None:
    """Exactly the README's command (the interpreter's default plan, 8 new tokens)."""
    smollm2_gguf()  # in the cache, as the command expects it
    code, out, err = run(capsys, "generate", "--model", "smollm2-135m", "--prompt",
                         "The capital of France is", "--backend", "cpu")
    assert code == 0, err
    assert "'The capital of France is' -> ' Paris." in out, out
    assert "random weights" not in err


def test_chat_applies_the_template(capsys: pytest.CaptureFixture[str]) -> None:
    path = smollm2_gguf()
    question = "What is the capital of Germany?"
    code, out, err = run(capsys, "generate", "--model", "smollm2-135m", "--chat", "--prompt",
                         question, "--backend", "cpu", "--num-sms", "2", "--max-new-tokens",
                         "12", "--json")
    assert code == 0, err
    result = json.loads(out)
    want = load_tokenizer(path).encode(load_chat_template(path).prompt(question),
                                       add_special_tokens=False).ids
    assert result["prompt_ids"] == [want] and result["random_weights"] is False
    assert "Berlin" in result["text"][0], result["text"]
    assert result["token_ids"][0][-1] == 2  # stopped at <|im_end|>, the model's EOS


def test_gguf_checkpoint_with_prompt_ids(capsys: pytest.CaptureFixture[str]) -> None:
    path = smollm2_gguf()
    ids = ",".join(map(str, load_tokenizer(path).encode("The capital of France is").ids))
    code, out, err = run(capsys, "generate", "--checkpoint", str(path), "--prompt-ids", ids,
                         "--backend", "cpu", "--num-sms", "2", "--max-new-tokens", "2")
    assert code == 0, err
    assert "-> ' Paris.'" in out, out


def test_chat_needs_prompt_text(capsys: pytest.CaptureFixture[str]) -> None:
    smollm2_gguf()
    code, _, err = run(capsys, "generate", "--model", "smollm2-135m", "--chat", "--prompt-ids",
                       "1,2", "--backend", "cpu")
    assert code == 2 and "--chat needs --prompt TEXT" in err and err.count("\n") == 1, err
