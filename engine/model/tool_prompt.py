"""Tools in a chat prompt: handed to a chat template that takes them, or written into the conversation for one
that does not (the fallback). ``TokenizerWrapper.render_chat`` and ``tickloom.prompts`` (for a tokenizer with no
template of its own, such as the stub model's) both apply it; applying it twice changes nothing.

A template takes tools when its source reads a ``tools`` variable (as transformers' ``apply_chat_template(tools=...)``
renders them: Qwen2.5, Llama 3.1, Hermes, Mistral...). It then gets the tools as given (OpenAI's
``{"type": "function", "function": {...}}`` form) and the messages as they are, earlier calls and tool results
included. A template that does not (SmolLM2's, the stub model's) gets the fallback, in the Hermes/Qwen format that
``tools.serve.tool_calls`` parses back:

- the tools' JSON, one per line between ``<tools>`` and ``</tools>``, and how to call one (a JSON object
  ``{"name": ..., "arguments": ...}`` between ``<tool_call>`` and ``</tool_call>``), appended to the first system
  message, or written as a new first one;
- an assistant message's earlier calls appended to its content in that same form;
- a run of ``tool`` messages as one ``user`` message, each result between ``<tool_response>`` and
  ``</tool_response>`` (many templates accept only ``system``, ``user`` and ``assistant``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.meta

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

FALLBACK_INSTRUCTIONS = (
    "# Tools\n\n"
    "You may call one or more functions to help with the user's request. The functions you may call are "
    "described, one JSON object per line, between <tools> and </tools>:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and its arguments between <tool_call> and "
    "</tool_call>, one per call:\n"
    "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n</tool_call>\n"
    "A function's result comes back between <tool_response> and </tool_response>."
)
"""What the fallback adds to the system message (``{tools}``: the tools' JSON, one per line)."""


@functools.lru_cache(maxsize=16)
def template_takes_tools(source: str | None) -> bool:
    """Whether a chat template's source reads a ``tools`` variable (a template that does not parse takes none: its
    rendering fails, and names why, later)."""
    if not source:
        return False
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.TemplateSyntaxError:
        return False


def has_tool_turns(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether a conversation holds earlier calls (an assistant's ``tool_calls``) or tool results."""
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def fit_template(source: str | None, messages: Sequence[dict[str, Any]],
                 tools: Sequence[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the tools to render with a template of this source: unchanged for a template that takes
    tools (or when there are neither tools nor tool turns), else the fallback's messages and no tools."""
    if not tools and not has_tool_turns(messages):
        return list(messages), None
    if template_takes_tools(source):
        return list(messages), list(tools) if tools else None
    return fallback_messages(messages, tools or ()), None


def fallback_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation rewritten for a template without tools (see the module's docstring)."""
    out: list[dict[str, Any]] = []
    after_tool = False
    for message in messages:
        role = message.get("role")
        if role == "tool":
            response = f"{TOOL_RESPONSE_OPEN}\n{message.get('content') or ''}\n{TOOL_RESPONSE_CLOSE}"
            if after_tool:
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            after_tool = True
            continue
        after_tool = False
        rewritten = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        calls = message.get("tool_calls") or []
        if calls:
            written = "\n".join(call_text(c) for c in calls)
            content = message.get("content") or ""
            rewritten["content"] = f"{content}\n{written}" if content else written
        out.append(rewritten)
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        instructions = FALLBACK_INSTRUCTIONS.format(tools=listed)
        if out and out[0].get("role") == "system":
            first = out[0].get("content") or ""
            out[0] = {**out[0], "content": f"{first}\n\n{instructions}" if first else instructions}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def call_text(call: dict[str, Any]) -> str:
    """One earlier call (OpenAI's ``{"id", "type", "function": {"name", "arguments"}}``, the arguments a JSON
    object or its text) as the fallback writes it."""
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        arguments = _json_or_text(arguments)
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def _json_or_text(text: str) -> Any:
    """The JSON value ``text`` holds, or the text itself where it holds none (written as the string it is)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


__all__ = ["FALLBACK_INSTRUCTIONS", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "TOOL_RESPONSE_CLOSE", "TOOL_RESPONSE_OPEN",
           "call_text", "fallback_messages", "fit_template", "has_tool_turns", "template_takes_tools"]
