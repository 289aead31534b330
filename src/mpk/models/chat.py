"""Chat templates: the Jinja template a checkpoint ships (GGUF metadata, or a HF folder's
tokenizer_config.json / chat_template.jinja), rendered the way transformers' apply_chat_template
renders it, so `mpk generate --chat` feeds the model the same text transformers would."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from mpk.errors import CheckpointError

Message = dict[str, str]


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's source plus the special tokens templates refer to by name."""

    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    origin: str = ""

    def render(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, ending with the assistant's turn opener."""
        import jinja2

        try:
            template = _compile(self.source)
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as e:
            raise CheckpointError(f"chat template of {self.origin or 'the model'} failed: "
                                  f"{e}") from None

    def prompt(self, user_text: str) -> str:
        """One user turn, ready for the assistant's answer."""
        return self.render([{"role": "user", "content": user_text}])


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    """The template compiled in transformers' environment: sandboxed, trim_blocks and
    lstrip_blocks (whitespace around tags differs without them), loop controls, and the
    raise_exception / strftime_now / tojson helpers templates call."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False,
                                                                   indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"chat template does not parse: {e}") from None


def hf_chat_template(folder: str | Path) -> ChatTemplate | None:
    """A Hugging Face folder's chat template (chat_template.jinja, else tokenizer_config.json's
    "chat_template"), or None."""
    folder = Path(folder)
    config: dict[str, Any] = {}
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{config_file} is not valid JSON: {e}") from None
    jinja_file = folder / "chat_template.jinja"
    source = jinja_file.read_text() if jinja_file.is_file() else config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        return None

    def token(key: str) -> str | None:
        value = config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    return ChatTemplate(source, token("bos_token"), token("eos_token"), origin=str(folder))


def load_chat_template(path: str | Path) -> ChatTemplate | None:
    """The chat template of a checkpoint (GGUF file or HF folder), or None when it has none."""
    from mpk.models.gguf import find_gguf, open_gguf
    from mpk.models.gguf_tokenizer import special_token

    gguf_file = find_gguf(path)
    if gguf_file is None:
        return hf_chat_template(path)
    f = open_gguf(gguf_file)
    source = f.get("tokenizer.chat_template")
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, special_token(f, "bos"), special_token(f, "eos"),
                        origin=str(gguf_file))
