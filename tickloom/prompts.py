"""A prompt's token ids from text or chat messages: checked, rendered with the model's chat template, tokenized.

One definition for every front end that tokenizes: ``Engine`` (``api.py``), the fleet's replicas
(``fleet/replica.py``) and the server's fleet backend (``tools/serve/fleet_backend.py``), so a prompt is refused,
or becomes the same ids, wherever it is sent. Token-id prompts are not handled here: only the engine knows the
vocabulary they are checked against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from tickloom.engine.errors import RequestRejected
from tickloom.engine.model.tool_prompt import fit_template
from tickloom.validation import checked, encodable, unencodable

Prompt = str | list[int] | Sequence[dict[str, Any]]
"""Text, token ids (used as given: no BOS is added) or chat messages (rendered with the model's template)."""

MAX_CHARS_PER_TOKEN = 1024
"""A text prompt longer than this many characters per ``max_seq_len`` token is refused before tokenizing."""


def text_prompt_ids(tokenizer: Any, prompt: Prompt, max_seq_len: int, *,
                    tools: Sequence[dict[str, Any]] | None = None) -> list[int] | None:
    """The token ids of a text or chat prompt (``RequestRejected`` names what is wrong); ``None`` for a list or tuple
    that is not chat messages (token ids, which the caller checks); ``RequestRejected`` for anything else. ``tools``
    (OpenAI's form) go to the chat template, or into the messages for a template without tools
    (``engine.model.tool_prompt``)."""
    if isinstance(prompt, str):
        encodable(prompt, "prompt")
        if len(prompt) > MAX_CHARS_PER_TOKEN * max_seq_len:
            raise RequestRejected(f"the prompt has {len(prompt)} characters; it cannot fit "
                                  f"max_seq_len={max_seq_len} tokens")
        return tokenize(tokenizer, prompt)
    if isinstance(prompt, list | tuple) and prompt and all(isinstance(m, dict) for m in prompt):
        return tokenize(tokenizer, [_chat_message(i, m) for i, m in enumerate(prompt)], tools=tools)
    if isinstance(prompt, list | tuple):
        return None
    raise RequestRejected("prompt must be a str, a list of token ids, or a list of chat messages, not "
                          f"{type(prompt).__name__}")


def tokenize(tokenizer: Any, prompt: str | list[dict[str, Any]], *,
             tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """Text encoded as is, or checked chat messages rendered with the generation prompt (and ``tools``: see
    ``text_prompt_ids``) and encoded without adding special tokens again (the template has them)."""
    if isinstance(prompt, str):
        try:
            return list(tokenizer.encode(prompt))
        except ValueError as exc:
            raise RequestRejected(f"the prompt cannot be tokenized: {exc}") from None
    bad = unencodable(list(tools or ()))
    if bad is not None:
        raise RequestRejected(f"tools{bad} is not encodable as UTF-8 (a lone surrogate)")
    messages, template_tools = fit_template(getattr(tokenizer, "chat_template", None), prompt, tools)
    extra = {} if template_tools is None else {"tools": template_tools}
    try:
        text = tokenizer.render_chat(messages, add_generation_prompt=True, **extra)
        return list(tokenizer.encode(text, add_special_tokens=False))
    except (ValueError, KeyError, TypeError) as exc:
        raise RequestRejected(f"the prompt's chat messages cannot be rendered and tokenized: {exc}") from None


class _ChatMessage(msgspec.Struct, frozen=True):
    role: Annotated[str, Meta(min_length=1, max_length=256)]
    content: str


def _chat_message(index: int, message: dict[Any, Any]) -> dict[str, Any]:
    """One chat message, checked: a str ``role`` and ``content``; other keys (str) are passed to the template."""
    what = f"prompt[{index}]"
    for key in ("role", "content"):
        if key not in message:
            raise RequestRejected(f"{what} has no {key!r}: a chat message needs 'role' and 'content'")
    bad_key = next((k for k in message if not isinstance(k, str)), None)
    if bad_key is not None:
        raise RequestRejected(f"{what} has a non-str key {bad_key!r}")
    checked({"role": message["role"], "content": message["content"]}, _ChatMessage, what)
    bad = unencodable(message)
    if bad is not None:
        raise RequestRejected(f"{what}{bad} is not encodable as UTF-8 (a lone surrogate)")
    return dict(message)


__all__ = ["MAX_CHARS_PER_TOKEN", "Prompt", "text_prompt_ids", "tokenize"]
