"""Tool calling on ``/v1/chat/completions``: what a request's ``tools`` and ``tool_choice`` ask for, the constraint
that enforces a required call, and the model's text read back as OpenAI's ``tool_calls``, whole or streamed.

- ``tool_choice="none"`` (the default without tools): the tools are not offered to the model, the text is the
  answer. Earlier tool turns in the conversation are still rendered.
- ``"auto"`` (the default with tools): the tools go to the chat template (``engine.model.tool_prompt``: the template's
  own support, or the Hermes/Qwen fallback) and the text is parsed (``TaggedCalls``): each ``<tool_call>{"name":
  ..., "arguments": ...}</tool_call>`` (an object, or a list of them) naming one of the tools is a call, and so is a
  whole answer that is only such JSON; anything else, malformed calls included, stays content.
- ``"required"`` and a named function: the output is constrained by a JSON schema built from the tools' parameter
  schemas (``required_schema``): for ``required`` a ``{"name", "arguments"}`` object, or with
  ``parallel_tool_calls`` (the default) a non-empty array of them; for a named function its arguments alone. The
  text is read by ``JsonCalls``. So the call always parses, unless ``max_tokens`` cuts it (then the text is the
  content and the finish ``length``).

A choice with calls finishes ``tool_calls`` where the engine said ``stop``. Streamed, a call goes out as OpenAI's
deltas: its ``index``, ``id``, ``type`` and ``function.name`` first, then ``function.arguments`` in pieces.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from tickloom.engine.model.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from tickloom.params import StructuredOutputs
from tickloom.tools.serve.openai_types import ChatCompletionRequest, FunctionCall, OpenAIError, ToolCall

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What one request's tool fields ask for."""

    mode: Mode
    tools: list[dict[str, Any]]
    """The tools as the chat template takes them (OpenAI's form)."""
    parallel: bool = True
    named: str | None = None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt offers: none with ``tool_choice="none"``."""
        return None if self.mode == "none" else self.tools

    def constraint(self) -> StructuredOutputs | None:
        """The JSON schema a required or named call is sampled under (None for ``auto`` and ``none``)."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.named)
            return StructuredOutputs(json=parameters_schema(tool))
        if self.mode == "required":
            return StructuredOutputs(json=required_schema(self.tools, self.parallel))
        return None

    def reader(self) -> CallReader:
        """A fresh reader for one choice's text."""
        if self.mode == "auto":
            return TaggedCalls(self.names, self.parallel)
        if self.mode in ("required", "named"):
            return JsonCalls(self.named)
        return PlainText()


def plan(req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan (None: no tools and no tool choice), or a 400 naming the field that is wrong."""
    choice = req.tool_choice
    tools = [msgspec_to_dict(t) for t in req.tools or ()]
    if not tools:
        if choice is not None and choice != "none":
            raise OpenAIError(400, "tool_choice needs tools: no tools were given", param="tool_choice")
        return None
    names = [t["function"]["name"] for t in tools]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise OpenAIError(400, f"tools name the function {twice!r} twice", param="tools")
    parallel = req.parallel_tool_calls is not False
    if choice is None or isinstance(choice, str):
        return ToolPlan(mode=choice or "auto", tools=tools, parallel=parallel)
    if choice.function.name not in names:
        raise OpenAIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among the "
                               f"tools ({', '.join(names)})", param="tool_choice")
    return ToolPlan(mode="named", tools=tools, parallel=False, named=choice.function.name)


def msgspec_to_dict(tool: Any) -> dict[str, Any]:
    """A ``Tool`` as the plain JSON the template and the schemas use (unset optional fields left out)."""
    function = {"name": tool.function.name}
    for key in ("description", "parameters", "strict"):
        value = getattr(tool.function, key)
        if value is not None:
            function[key] = value
    return {"type": "function", "function": function}


# -- the constraint --------------------------------------------------------------------------------------------------


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's arguments schema (none given: any JSON object)."""
    params = tool["function"].get("parameters")
    return dict(params) if params else {"type": "object"}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The schema of a required call: ``{"name": <one of the tools>, "arguments": <its parameters>}``, or a
    non-empty array of those. Each tool's own ``$defs`` (``definitions``) move to the top, renamed ``t<i>_<name>``,
    so its ``$ref``s still resolve once its schema sits inside another; a tool whose schema refers to itself in
    another way (``"$ref": "#"``, a path into its properties) is moved to the top whole, as ``tool<i>``."""
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        arguments = _hoisted(parameters_schema(tool), i, defs)
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                                       "arguments": arguments},
                      "required": ["name", "arguments"], "additionalProperties": False})
    one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": one, "minItems": 1} if parallel else dict(one)
    if defs:
        schema["$defs"] = defs
    return schema


def _hoisted(schema: dict[str, Any], i: int, defs: dict[str, Any]) -> dict[str, Any]:
    own: dict[str, Any] = {**schema.pop("$defs", {}), **schema.pop("definitions", {})}
    renamed = {name: f"t{i}_{name}" for name in own}
    other_refs: list[bool] = []

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rewrite(v) for k, v in node.items()}
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                for prefix in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(prefix) and ref[len(prefix):] in renamed:
                        out["$ref"] = "#/$defs/" + renamed[ref[len(prefix):]]
                        break
                else:
                    other_refs.append(True)
                    out["$ref"] = f"#/$defs/tool{i}{ref[1:]}"
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    body = rewrite(schema)
    for name, sub in own.items():
        defs[renamed[name]] = rewrite(sub)
    if other_refs:
        defs[f"tool{i}"] = body
        return {"$ref": f"#/$defs/tool{i}"}
    return dict(body)


# -- reading calls back ----------------------------------------------------------------------------------------------


@dataclass
class Piece:
    """What one read of the text gives: content, and call pieces (``index``; ``name`` and ``id`` on a call's first
    piece; ``arguments`` text)."""

    content: str = ""
    calls: list[tuple[int, str | None, str | None, str]] = field(default_factory=list)
    """(index, id or None, name or None, arguments text)."""


class CallReader:
    """Reads one choice's text as it comes (``feed``) and at its end (``finish``)."""

    def __init__(self) -> None:
        self.count = 0
        """Calls begun (so far)."""

    def feed(self, text: str) -> Piece:
        raise NotImplementedError

    def finish(self) -> Piece:
        raise NotImplementedError

    def _new_call(self) -> tuple[int, str]:
        index, self.count = self.count, self.count + 1
        return index, f"call_{uuid.uuid4().hex[:24]}"


class PlainText(CallReader):
    """``tool_choice="none"``: the text is content."""

    def feed(self, text: str) -> Piece:
        return Piece(content=text)

    def finish(self) -> Piece:
        return Piece()


class TaggedCalls(CallReader):
    """``auto``: ``<tool_call>...</tool_call>`` blocks become calls once closed (each in one piece); text outside
    them is content as it comes, but for a tail that may begin a tag. An answer whose first text is ``{`` or ``[``
    is held to its end: if it is all one call's JSON (or a list of them) it is the call, else content."""

    def __init__(self, names: frozenset[str], parallel: bool) -> None:
        super().__init__()
        self.names = names
        self.parallel = parallel
        self.pending = ""
        self.in_call = False
        self.bare: bool | None = None
        """Whether the answer may be bare JSON (None: nothing but whitespace seen yet)."""

    def feed(self, text: str) -> Piece:
        self.pending += text
        out = Piece()
        if self.bare is None and self.pending.strip():
            self.bare = self.pending.lstrip()[0] in "{["
        if self.bare:
            return out
        while True:
            if self.in_call:
                end = self.pending.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return out
                body, self.pending = self.pending[:end], self.pending[end + len(TOOL_CALL_CLOSE):]
                self.in_call = False
                self._take(body, f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}", out)
                continue
            start = self.pending.find(TOOL_CALL_OPEN)
            if start < 0:
                keep = _partial_tag_tail(self.pending)
                out.content += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                return out
            out.content += self.pending[:start]
            self.pending = self.pending[start + len(TOOL_CALL_OPEN):]
            self.in_call = True

    def finish(self) -> Piece:
        out = Piece()
        if self.bare:
            self._take(self.pending, self.pending, out)
        elif self.in_call:
            self._take(self.pending, TOOL_CALL_OPEN + self.pending, out)
        else:
            out.content = self.pending
        self.pending = ""
        return out

    def _take(self, body: str, raw: str, out: Piece) -> None:
        """The calls in ``body`` into ``out``; if it holds none that parse, ``raw`` is content."""
        calls = _calls_in(body, self.names)
        if not calls or (not self.parallel and self.count + len(calls) > 1):
            out.content += raw
            return
        for name, arguments in calls:
            index, call_id = self._new_call()
            out.calls.append((index, call_id, name, arguments))


def _partial_tag_tail(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for keep in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-keep:]):
            return keep
    return 0


def _calls_in(body: str, names: frozenset[str]) -> list[tuple[str, str]]:
    """(name, arguments as JSON text) of each call in ``body``: one object or a list of them, each naming a tool
    and holding its arguments (``arguments`` or ``parameters``: an object, or its JSON text); [] if anything is
    off."""
    try:
        value = json.loads(body)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                return []
            arguments = parsed
        if not isinstance(arguments, dict):
            return []
        calls.append((str(item["name"]), json.dumps(arguments, ensure_ascii=False)))
    return calls


class JsonCalls(CallReader):
    """``required`` and a named function: the text is the constrained JSON, read as it comes. For a named function
    it is the arguments, streamed as they come. For ``required`` it is one ``{"name", "arguments"}`` object or an
    array of them: each call goes out once its name is read, then its arguments text as it grows (the exact text
    the model wrote, so a whole answer's arguments are the stream's joined)."""

    def __init__(self, named: str | None) -> None:
        super().__init__()
        self.named = named
        self.text: list[str] = []
        self.scanner = _CallScanner()
        self.sent_args: dict[int, int] = {}
        self.started: dict[int, int] = {}
        """Scanner call -> our call index, for calls whose name went out."""

    def feed(self, text: str) -> Piece:
        self.text.append(text)
        out = Piece()
        if self.named is not None:
            if self.count == 0:
                index, call_id = self._new_call()
                out.calls.append((index, call_id, self.named, ""))
            if text:
                out.calls.append((0, None, None, text))
            return out
        self.scanner.feed(text)
        for k, call in enumerate(self.scanner.calls):
            if call.name is None:
                continue
            if k not in self.started:
                index, call_id = self._new_call()
                self.started[k] = index
                out.calls.append((index, call_id, call.name, ""))
            args = call.arguments_so_far(self.scanner.text)
            sent = self.sent_args.get(k, 0)
            if len(args) > sent:
                out.calls.append((self.started[k], None, None, args[sent:]))
                self.sent_args[k] = len(args)
        return out

    def finish(self) -> Piece:
        return Piece()

    def parsed(self) -> bool:
        """Whether the whole text is the JSON the constraint asks for (a cut one is not)."""
        try:
            value = json.loads("".join(self.text))
        except ValueError:
            return False
        if self.named is not None:
            return isinstance(value, dict)
        items = value if isinstance(value, list) else [value]
        return bool(items) and all(isinstance(i, dict) and isinstance(i.get("name"), str) and "arguments" in i
                                   for i in items)


@dataclass
class _ScannedCall:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None

    def arguments_so_far(self, text: str) -> str:
        if self.args_start is None:
            return ""
        return text[self.args_start:self.args_end if self.args_end is not None else len(text)]


class _CallScanner:
    """An incremental reader of JSON text shaped ``{"name": ..., "arguments": ...}`` or an array of those: where
    each call's name is, and where its arguments' text starts and ends. It follows nesting and strings only; the
    constraint makes the text valid, and ``JsonCalls.parsed`` checks the whole at the end."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.stack: list[str] = []
        self.call_depth: int | None = None
        """How deep a call's object is: 1 for one call, 2 in an array."""
        self.calls: list[_ScannedCall] = []
        self.in_string = False
        self.escaped = False
        self.string_start = 0
        self.where = "key"
        """In a call's object: before a ``key``, at its ``colon``, before its ``value``, ``in_value``, ``after`` it."""
        self.key: str | None = None

    def feed(self, text: str) -> None:
        self.text += text
        while self.pos < len(self.text):
            self._step(self.text[self.pos])
            self.pos += 1

    def _at_call(self) -> bool:
        return self.call_depth is not None and len(self.stack) == self.call_depth

    def _step(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self._string_closed(self.text[self.string_start:self.pos + 1])
            return
        if ch.isspace():
            return
        at_call = self._at_call()
        if at_call and self.where == "value":
            self.where = "in_value"
            if self.key == "arguments" and self.calls and self.calls[-1].args_start is None:
                self.calls[-1].args_start = self.pos
        if ch == '"':
            self.in_string, self.string_start = True, self.pos
        elif ch in "{[":
            if self.call_depth is None:
                self.call_depth = 1 if ch == "{" else 2
            self.stack.append(ch)
            if ch == "{" and self._at_call():
                self.calls.append(_ScannedCall())
                self.where = "key"
        elif ch in "}]":
            if at_call and self.where == "in_value":  # a number, true, false or null ends here
                self._value_ended(len(self.text[:self.pos].rstrip()))
            if self.stack:
                self.stack.pop()
            if self._at_call() and self.where == "in_value":  # an object or array value closed
                self._value_ended(self.pos + 1)
        elif ch == "," and at_call:
            if self.where == "in_value":
                self._value_ended(len(self.text[:self.pos].rstrip()))
            self.where = "key"
        elif ch == ":" and at_call and self.where == "colon":
            self.where = "value"

    def _string_closed(self, raw: str) -> None:
        if not self._at_call():
            return
        if self.where == "key":
            self.key = _loads_str(raw)
            self.where = "colon"
        elif self.where == "in_value":
            if self.key == "name" and self.calls and self.calls[-1].name is None:
                self.calls[-1].name = _loads_str(raw)
            self._value_ended(self.pos + 1)

    def _value_ended(self, end: int) -> None:
        if self.key == "arguments" and self.calls and self.calls[-1].args_end is None:
            self.calls[-1].args_end = end
        self.where = "after"


def _loads_str(raw: str) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


# -- a whole choice --------------------------------------------------------------------------------------------------


def read_whole(tool_plan: ToolPlan, text: str,
               finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
    """A whole choice's content, calls and finish reason (``tool_calls`` where it made calls and stopped)."""
    reader = tool_plan.reader()
    pieces = [reader.feed(text), reader.finish()]
    if isinstance(reader, JsonCalls) and not reader.parsed():
        return text, [], finish_reason
    content = "".join(p.content for p in pieces)
    calls = assemble([c for p in pieces for c in p.calls])
    if not calls:
        return content, [], finish_reason
    return content.strip() or None, calls, "tool_calls" if finish_reason == "stop" else finish_reason


def assemble(pieces: list[tuple[int, str | None, str | None, str]]) -> list[ToolCall]:
    """Call pieces joined by index, as a client joins streamed deltas."""
    calls: dict[int, ToolCall] = {}
    for index, call_id, name, arguments in pieces:
        if index not in calls:
            calls[index] = ToolCall(id=call_id or "", function=FunctionCall(name=name or "", arguments=""))
        calls[index].function.arguments += arguments
    return [calls[i] for i in sorted(calls)]


__all__ = ["CallReader", "JsonCalls", "Piece", "PlainText", "TaggedCalls", "ToolPlan", "assemble", "plan",
           "read_whole", "required_schema"]
