"""Chat templates of Hugging Face folders, rendered as transformers renders them, and the CLI's
--chat errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mpk.cli import main
from mpk.errors import CheckpointError
from mpk.models.chat import ChatTemplate, load_chat_template

TEMPLATE = ("{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


def test_folder_template_from_tokenizer_config(tmp_path: Path) -> None:
    assert load_chat_template(tmp_path) is None
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    template = load_chat_template(tmp_path)
    assert template.render(MESSAGES) == "<s>user: hi\nassistant:"
    assert template.render(MESSAGES, add_generation_prompt=False) == "<s>user: hi\n"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")
    assert load_chat_template(tmp_path).prompt("hi") == "HI"  # the .jinja file wins


def test_template_matches_transformers(tmp_path: Path) -> None:
    """trim_blocks / lstrip_blocks and the helpers, against transformers' renderer."""
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    source = ("{% for m in messages %}\n  {% if m['role'] == 'user' %}\n    U {{ m['content'] "
              "| tojson }}\n  {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}A:{% endif %}")
    ours = ChatTemplate(source).render(MESSAGES)
    theirs = render_jinja_template(conversations=[MESSAGES], chat_template=source,
                                   add_generation_prompt=True)[0][0]
    assert ours == theirs and ours.startswith("    U \"hi\"")


def test_template_errors_are_checkpoint_errors() -> None:
    with pytest.raises(CheckpointError, match="boom"):
        ChatTemplate("{{ raise_exception('boom') }}", origin="x").prompt("hi")
    with pytest.raises(CheckpointError, match="does not parse"):
        ChatTemplate("{% for %}").prompt("hi")


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "tiny-qwen3", "--chat"], "needs a tokenizer"),
    (["--model", "tiny-qwen3", "--chat", "--prompt-ids", "1,2"], "needs a tokenizer"),
])
def test_chat_errors(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code = main(["generate", *args, "--backend", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") <= 2, err
