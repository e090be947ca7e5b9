"""A request's structured-output fields as the one ``StructuredOutputs`` the engine enforces.

Honoured on both endpoints, each mapped to one field of ``StructuredOutputs`` (vLLM's ``StructuredOutputsParams``):

- ``response_format``: ``{"type": "json_object"}`` is ``json_object`` (any JSON object), or ``json`` with
  llama.cpp's ``"schema"`` beside it; ``{"type": "json_schema", "json_schema": {"schema": ..., "strict": ...}}`` is
  ``json`` (enforced, strict or not; without a ``schema``, ``json_object``);
- ``structured_outputs`` (vLLM): its one field, as it is;
- ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (vLLM's older names): ``json``,
  ``regex``, ``choice``, ``grammar``;
- llama.cpp's ``json_schema`` and ``grammar`` (GBNF): ``json`` and ``grammar``.

``response_format: {"type": "text"}`` asks for nothing. A required tool call (``tool_choice``: ``required`` or a
named function) is a constraint too (``tool_calls.ToolPlan.constraint``: a schema built from the tools'). Two
constraints in one request is a 400 naming both. Whether one is well formed and compiles is the
engine's to say (``RequestRejected`` naming the position): ``translate.rejected`` names the request's field.
"""

from __future__ import annotations

from typing import Any

from tickloom.params import StructuredOutputs
from tickloom.tools.serve import tool_calls
from tickloom.tools.serve.openai_types import ChatCompletionRequest, OpenAIError

_LEGACY = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"), ("json_schema", "json"), ("grammar", "grammar"))
"""(request field, ``StructuredOutputs`` field) of the single-valued fields."""
_STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def requested(req: Any) -> list[tuple[str, StructuredOutputs]]:
    """Every constraint the request asks for, with the request field that asks."""
    found: list[tuple[str, StructuredOutputs]] = []
    fmt = req.response_format
    if fmt is not None:
        if fmt.type == "text":
            if fmt.json_schema is not None or fmt.schema is not None:
                raise OpenAIError(400, "response_format of type 'text' takes no schema", param="response_format")
        elif fmt.type == "json_object":
            if fmt.json_schema is not None:
                raise OpenAIError(400, "response_format of type 'json_object' takes no json_schema (a schema is "
                                       "type 'json_schema')", param="response_format.json_schema")
            found.append(("response_format", _json(fmt.schema)))
        else:
            if fmt.json_schema is None:
                raise OpenAIError(400, "response_format of type 'json_schema' needs json_schema",
                                  param="response_format.json_schema")
            if fmt.schema is not None:
                raise OpenAIError(400, "response_format of type 'json_schema' holds its schema in json_schema.schema",
                                  param="response_format.schema")
            found.append(("response_format", _json(fmt.json_schema.schema)))
    given = req.structured_outputs
    if given is not None:
        values = {name: getattr(given, name) for name in _STRUCTURED_FIELDS
                  if getattr(given, name) not in (None, False)}
        if len(values) != 1:
            raise OpenAIError(400, f"structured_outputs: set exactly one of {', '.join(_STRUCTURED_FIELDS)} (got "
                                   f"{', '.join(values) or 'none'})", param="structured_outputs")
        found.append(("structured_outputs", StructuredOutputs(**values)))
    for name, key in _LEGACY:
        value = getattr(req, name)
        if value is not None:
            found.append((name, StructuredOutputs(**{key: value})))
    if isinstance(req, ChatCompletionRequest):
        tool_plan = tool_calls.plan(req)
        constraint = None if tool_plan is None else tool_plan.constraint()
        if constraint is not None:
            found.append(("tool_choice", constraint))
    return found


def constraint(req: Any) -> tuple[str, StructuredOutputs] | None:
    """The request's one constraint and the field that asks for it (None: unconstrained); two is a 400."""
    found = requested(req)
    if len(found) > 1:
        names = [name for name, _ in found]
        raise OpenAIError(400, f"{names[0]} and {names[1]} both ask for a structured output: give one of them",
                          param=names[1], code="conflicting_fields")
    return found[0] if found else None


def _json(schema: dict[str, Any] | None) -> StructuredOutputs:
    return StructuredOutputs(json_object=True) if schema is None else StructuredOutputs(json=schema)


__all__ = ["constraint", "requested"]
