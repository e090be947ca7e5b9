"""Tokenizer wrapper: the ``tokenizers`` library for text, jinja2 for chat templates.

transformers is never imported here; it is only a reference in tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

from tickloom.engine.model.errors import ModelLoadError
from tickloom.engine.model.tool_prompt import fit_template


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


MAX_CHAT_TEMPLATE_CHARS = 1 << 20
"""The longest chat template taken (models' own are a few KiB; the largest known, about 30 KiB)."""

_JINJA_CHARS = "{}\n"


def load_chat_template(source: str) -> str:
    """A chat template given as a file's path or as the template itself, as vLLM's ``--chat-template`` takes it: a
    file that exists is read; other text is the template if it has one of Jinja's characters (``{``, ``}``, a
    newline), else it is taken for a path that is not there. The template is compiled here, so one that does not
    compile, or reads as no template at all, is a ``ValueError`` saying why (with the line)."""
    if os.path.isfile(source):  # False, not an error, for text no file can be named by (too long, a NUL)
        try:
            if os.path.getsize(source) > MAX_CHAT_TEMPLATE_CHARS:
                raise ValueError(f"the file {source!r} is larger than {MAX_CHAT_TEMPLATE_CHARS} bytes")
            text = Path(source).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the template file {source!r}: {exc}") from None
        if not any(char in text for char in _JINJA_CHARS):
            raise ValueError(f"the file {source!r} holds no template (no {{, }} or newline in it)")
    elif any(char in source for char in _JINJA_CHARS):
        text = source
    else:
        raise ValueError("no such file, and not a template (no {, } or newline in it)")
    try:
        _compile_template(text)
    except jinja2.exceptions.TemplateError as exc:
        where = f"line {exc.lineno}: " if isinstance(exc, jinja2.exceptions.TemplateSyntaxError) else ""
        raise ValueError(f"the template does not compile: {where}{exc.message}") from None
    return text


def _token_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value)


class ChatTemplateError(ValueError):
    """The chat template could not render the messages (a ``ValueError``, so callers reject the request)."""


class TokenizerWrapper:
    """Encode, decode and render chat templates for one model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _compile_template(chat_template) if chat_template else None
        ids = list(eos_token_ids)
        if not ids and eos_token is not None:
            tid = tokenizer.token_to_id(eos_token)
            if tid is not None:
                ids = [tid]
        self.eos_token_ids: tuple[int, ...] = tuple(ids)

    def replace_chat_template(self, template: str) -> None:
        """Render chats with ``template`` (its text, ``load_chat_template``'s) instead of the model's own."""
        self._template = _compile_template(template)
        self.chat_template = template

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.token_to_id(self.bos_token) if self.bos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None, **extra: Any) -> str:
        """Render messages with the model's chat template, as transformers' tokenizer does. ``tools`` (OpenAI's
        ``{"type": "function", "function": {...}}`` form) reach the template as its ``tools`` variable, as with
        ``apply_chat_template(tools=...)``; a template that does not read them gets them, and the earlier calls and
        tool results, written into the messages instead (``tool_prompt``'s fallback)."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        messages, template_tools = fit_template(self.chat_template, messages, tools)
        if template_tools is not None:
            extra["tools"] = template_tools
        try:
            return str(
                self._template.render(
                    messages=list(messages),
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token or "",
                    eos_token=self.eos_token or "",
                    **extra,
                )
            )
        except jinja2.exceptions.TemplateError as exc:  # raise_exception(), undefined fields, sandbox refusals
            raise ChatTemplateError(f"the chat template refused the messages: {type(exc).__name__}: {exc}") from exc

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)

    @classmethod
    def from_dir(cls, path: Path) -> TokenizerWrapper:
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(tj, "tokenizer.json not found")
        try:
            tok = Tokenizer.from_file(str(tj))
        except Exception as exc:
            raise ModelLoadError(tj, f"cannot parse tokenizer: {exc}") from exc
        cfg: dict[str, Any] = {}
        tc = path / "tokenizer_config.json"
        if tc.is_file():
            try:
                cfg = json.loads(tc.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise ModelLoadError(tc, f"unreadable tokenizer config: {exc}") from exc
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jt = path / "chat_template.jinja"
        if template is None and jt.is_file():
            template = jt.read_text(encoding="utf-8")
        eos_ids: list[int] = []
        gc = path / "generation_config.json"
        if gc.is_file():
            try:
                eos_raw = json.loads(gc.read_text(encoding="utf-8")).get("eos_token_id")
            except (OSError, json.JSONDecodeError) as exc:
                raise ModelLoadError(gc, f"unreadable generation config: {exc}") from exc
            if isinstance(eos_raw, list):
                eos_ids = [int(e) for e in eos_raw]
            elif eos_raw is not None:
                eos_ids = [int(eos_raw)]
        return cls(
            tok,
            chat_template=template if isinstance(template, str) else None,
            bos_token=_token_text(cfg.get("bos_token")),
            eos_token=_token_text(cfg.get("eos_token")),
            eos_token_ids=eos_ids,
        )
