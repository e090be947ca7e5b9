"""A JSON-schema suite for structured outputs, as data: each case has a schema, a short user prompt asking a model
for such JSON, and a hand-written example the schema accepts, its keys in the
order of the schema's ``properties`` (the order a constrained output takes).

``tests/test_model_structured.py`` checks that llguidance compiles every schema and that ``jsonschema`` accepts
every example; the end-to-end test on the model and ``tools/bench/structured_engines.py`` use the same cases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    name: str
    schema: dict[str, Any]
    prompt: str
    example: Any


def _obj(props: dict[str, Any], required: list[str] | None = None, closed: bool = True) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": props, "required": list(props) if required is None
                              else required}
    if closed:
        schema["additionalProperties"] = False
    return schema


_S = {"type": "string"}
_I = {"type": "integer"}
_N = {"type": "number"}
_B = {"type": "boolean"}

CASES: list[SchemaCase] = [
    # -- objects ----------------------------------------------------------------------------------------------
    SchemaCase("person", _obj({"name": _S, "age": _I}), "Give a person's name and age as JSON.",
               {"name": "Ada", "age": 36}),
    SchemaCase("point", _obj({"x": _N, "y": _N}), "Give a point in the plane as JSON with x and y.",
               {"x": 1.5, "y": -2}),
    SchemaCase("flags", _obj({"enabled": _B, "visible": _B}), "Give two boolean flags, enabled and visible, as JSON.",
               {"enabled": True, "visible": False}),
    SchemaCase("open_object", {"type": "object", "properties": {"id": _I}, "required": ["id"]},
               "Give a JSON object with an integer id and anything else you like.", {"id": 7, "note": "extra"}),
    SchemaCase("optional_fields", _obj({"title": _S, "subtitle": _S, "pages": _I}, required=["title"]),
               "Describe a book as JSON: a title, and optionally a subtitle and page count.",
               {"title": "Dune", "pages": 412}),
    SchemaCase("all_optional", _obj({"a": _S, "b": _I}, required=[]), "Give a JSON object with optional a and b.",
               {}),
    SchemaCase("empty_object", {"type": "object", "additionalProperties": False}, "Give an empty JSON object.", {}),
    SchemaCase("typed_additional", {"type": "object", "additionalProperties": _I},
               "Give word counts as a JSON object mapping words to integers.", {"the": 3, "cat": 1}),
    SchemaCase("nested_address", _obj({"name": _S, "address": _obj({"street": _S, "city": _S, "zip": _S})}),
               "Give a person's name and postal address as JSON.",
               {"name": "Bo", "address": {"street": "1 Main St", "city": "Oslo", "zip": "0150"}}),
    SchemaCase("deep_nesting", _obj({"a": _obj({"b": _obj({"c": _obj({"d": _I})})})}),
               "Give a JSON object nested four levels deep ending in an integer d.",
               {"a": {"b": {"c": {"d": 4}}}}),
    SchemaCase("many_fields", _obj({f"field_{i}": _S for i in range(12)}),
               "Fill in twelve string fields, field_0 to field_11, as JSON.",
               {f"field_{i}": str(i) for i in range(12)}),
    # -- arrays -----------------------------------------------------------------------------------------------
    SchemaCase("string_list", {"type": "array", "items": _S}, "List some fruits as a JSON array of strings.",
               ["apple", "pear"]),
    SchemaCase("bounded_list", {"type": "array", "items": _I, "minItems": 2, "maxItems": 4},
               "Give two to four integers as a JSON array.", [1, 2, 3]),
    SchemaCase("exact_list", {"type": "array", "items": _S, "minItems": 3, "maxItems": 3},
               "Name exactly three primary colors as a JSON array.", ["red", "green", "blue"]),
    SchemaCase("nonempty_list", _obj({"tags": {"type": "array", "items": _S, "minItems": 1}}),
               "Give at least one tag for a blog post as JSON.", {"tags": ["python"]}),
    SchemaCase("object_list", {"type": "array", "items": _obj({"name": _S, "qty": _I}), "maxItems": 5},
               "List up to five shopping items with quantities as JSON.", [{"name": "eggs", "qty": 12}]),
    SchemaCase("matrix", {"type": "array", "items": {"type": "array", "items": _N, "minItems": 2, "maxItems": 2},
                          "minItems": 2, "maxItems": 2},
               "Give a 2x2 matrix of numbers as a JSON array of arrays.", [[1, 0], [0, 1]]),
    SchemaCase("tuple", {"type": "array", "prefixItems": [_S, _I, _B], "items": False, "minItems": 3},
               "Give a name, an age and whether they are a student, as a JSON array.", ["Kim", 20, True]),
    SchemaCase("unique_free_list", {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 10},
               "Give up to ten non-negative integers as a JSON array.", [0, 5, 5]),
    # -- enums and constants ----------------------------------------------------------------------------------
    SchemaCase("enum_string", _obj({"color": {"enum": ["red", "green", "blue"]}}),
               "Pick a color, red, green or blue, as JSON.", {"color": "green"}),
    SchemaCase("enum_mixed", _obj({"level": {"enum": [1, 2, 3, "max", None]}}),
               "Give a level: 1, 2, 3, \"max\" or null, as JSON.", {"level": "max"}),
    SchemaCase("const", _obj({"version": {"const": "1.0"}, "ok": _B}),
               "Give a JSON object with version 1.0 and an ok flag.", {"version": "1.0", "ok": True}),
    SchemaCase("sentiment", _obj({"text": _S, "sentiment": {"type": "string",
                                                            "enum": ["positive", "negative", "neutral"]}}),
               "Classify the sentiment of 'I love it' as JSON.", {"text": "I love it", "sentiment": "positive"}),
    SchemaCase("enum_list", {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]}, "maxItems": 5},
               "List some weekdays as JSON, using mon to fri.", ["mon", "wed"]),
    # -- anyOf, oneOf, allOf ----------------------------------------------------------------------------------
    SchemaCase("any_of_scalar", _obj({"value": {"anyOf": [_S, _I]}}), "Give a value that is a string or an integer.",
               {"value": 42}),
    SchemaCase("any_of_objects", {"anyOf": [_obj({"kind": {"const": "circle"}, "radius": _N}),
                                            _obj({"kind": {"const": "square"}, "side": _N})]},
               "Describe a circle or a square as JSON.", {"kind": "square", "side": 2}),
    SchemaCase("one_of", _obj({"id": {"oneOf": [{"type": "integer"}, {"type": "string", "pattern": "^[a-z]+$"}]}}),
               "Give an id, an integer or a lowercase word, as JSON.", {"id": "abc"}),
    SchemaCase("all_of", {"allOf": [{"type": "object", "properties": {"a": _I}, "required": ["a"]},
                                    {"type": "object", "properties": {"b": _S}, "required": ["b"]}]},
               "Give a JSON object with an integer a and a string b.", {"a": 1, "b": "x"}),
    SchemaCase("type_list", _obj({"maybe": {"type": ["string", "null"]}}), "Give a string or null as 'maybe'.",
               {"maybe": None}),
    # -- $ref and $defs ---------------------------------------------------------------------------------------
    SchemaCase("defs_ref", {"$defs": {"pt": _obj({"x": _I, "y": _I})}, **_obj({"start": {"$ref": "#/$defs/pt"},
                                                                            "end": {"$ref": "#/$defs/pt"}})},
               "Give a line segment with integer start and end points as JSON.",
               {"start": {"x": 0, "y": 0}, "end": {"x": 3, "y": 4}}),
    SchemaCase("recursive_tree", {"$defs": {"node": _obj({"value": _I, "children": {
        "type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}}, required=["value"])},
        "$ref": "#/$defs/node"}, "Give a small tree of integers as JSON, each node with a value and children.",
        {"value": 1, "children": [{"value": 2}, {"value": 3, "children": []}]}),
    SchemaCase("definitions_ref", {"definitions": {"name": {"type": "string", "minLength": 1}},
                                   **_obj({"first": {"$ref": "#/definitions/name"},
                                           "last": {"$ref": "#/definitions/name"}})},
               "Give a first and last name as JSON.", {"first": "Grace", "last": "Hopper"}),
    # -- strings ----------------------------------------------------------------------------------------------
    SchemaCase("pattern_code", _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}),
               "Give a product code like ABC-1234 as JSON.", {"code": "XYZ-0042"}),
    SchemaCase("pattern_phone", _obj({"phone": {"type": "string", "pattern": r"^\+?[0-9]{7,12}$"}}),
               "Give a phone number of digits as JSON.", {"phone": "+4712345678"}),
    SchemaCase("pattern_hex_color", _obj({"color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
               "Give a lowercase hex color like #a1b2c3 as JSON.", {"color": "#ff8800"}),
    SchemaCase("string_lengths", _obj({"username": {"type": "string", "minLength": 3, "maxLength": 12}}),
               "Give a username of 3 to 12 characters as JSON.", {"username": "ada_l"}),
    SchemaCase("short_summary", _obj({"summary": {"type": "string", "maxLength": 40}}),
               "Summarize 'the cat sat on the mat' in at most 40 characters, as JSON.", {"summary": "A cat sat."}),
    SchemaCase("format_date", _obj({"birthday": {"type": "string", "format": "date"}}),
               "Give a birthday as a JSON date (YYYY-MM-DD).", {"birthday": "1990-05-17"}),
    SchemaCase("format_date_time", _obj({"at": {"type": "string", "format": "date-time"}}),
               "Give a meeting time as a JSON date-time.", {"at": "2024-03-01T09:30:00Z"}),
    SchemaCase("format_time", _obj({"alarm": {"type": "string", "format": "time"}}),
               "Give an alarm time as JSON (HH:MM:SS with a zone).", {"alarm": "07:15:00Z"}),
    SchemaCase("format_email", _obj({"email": {"type": "string", "format": "email"}}),
               "Give a contact email address as JSON.", {"email": "ada@example.com"}),
    SchemaCase("format_uuid", _obj({"id": {"type": "string", "format": "uuid"}}), "Give a UUID as JSON.",
               {"id": "123e4567-e89b-12d3-a456-426614174000"}),
    SchemaCase("format_ipv4", _obj({"ip": {"type": "string", "format": "ipv4"}}), "Give an IPv4 address as JSON.",
               {"ip": "192.168.1.10"}),
    SchemaCase("format_ipv6", _obj({"ip": {"type": "string", "format": "ipv6"}}), "Give an IPv6 address as JSON.",
               {"ip": "2001:db8::1"}),
    SchemaCase("format_hostname", _obj({"host": {"type": "string", "format": "hostname"}}),
               "Give a server's hostname as JSON.", {"host": "api.example.org"}),
    # -- numbers ----------------------------------------------------------------------------------------------
    SchemaCase("int_bounds", _obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}}),
               "Give an age between 0 and 120 as JSON.", {"age": 42}),
    SchemaCase("number_exclusive", _obj({"ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
               "Give a ratio strictly between 0 and 1 as JSON.", {"ratio": 0.25}),
    SchemaCase("negative_range", _obj({"celsius": {"type": "integer", "minimum": -50, "maximum": -1}}),
               "Give a freezing temperature in Celsius (an integer from -50 to -1) as JSON.", {"celsius": -12}),
    SchemaCase("rating", _obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "review": _S}),
               "Rate a restaurant from 1 to 5 stars with a short review, as JSON.", {"stars": 4, "review": "Good."}),
    SchemaCase("price", _obj({"amount": {"type": "number", "minimum": 0}, "currency": {"enum": ["USD", "EUR"]}}),
               "Give a price with an amount and a currency (USD or EUR) as JSON.", {"amount": 9.99, "currency": "EUR"}),
    # -- null, booleans, mixtures -----------------------------------------------------------------------------
    SchemaCase("nullable", _obj({"middle_name": {"anyOf": [_S, {"type": "null"}]}, "name": _S}),
               "Give a name and a middle name, or null, as JSON.", {"middle_name": None, "name": "Al"}),
    SchemaCase("null_only", _obj({"nothing": {"type": "null"}}), "Give a JSON object whose 'nothing' is null.",
               {"nothing": None}),
    SchemaCase("boolean_answer", _obj({"answer": _B, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
               "Is the sky blue? Answer as JSON with a boolean and a confidence.", {"answer": True, "confidence": 0.9}),
    SchemaCase("tool_call", _obj({"name": {"enum": ["get_weather", "get_time"]},
                                  "arguments": _obj({"city": _S, "unit": {"enum": ["c", "f"]}}, required=["city"])}),
               "Call a tool to get the weather in Paris, as JSON with name and arguments.",
               {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}),
    SchemaCase("event", _obj({"title": {"type": "string", "minLength": 1, "maxLength": 60},
                              "date": {"type": "string", "format": "date"},
                              "attendees": {"type": "array", "items": {"type": "string", "format": "email"},
                                            "maxItems": 4},
                              "online": _B}, required=["title", "date"]),
               "Plan a team meeting as JSON: title, date, attendee emails and whether it is online.",
               {"title": "Sync", "date": "2025-01-02", "attendees": ["a@b.co"], "online": True}),
    SchemaCase("invoice", {"$defs": {"line": _obj({"item": _S, "qty": {"type": "integer", "minimum": 1},
                                                   "price": {"type": "number", "minimum": 0}})},
                           **_obj({"number": {"type": "string", "pattern": "^INV-[0-9]{5}$"},
                                   "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1,
                                             "maxItems": 3},
                                   "paid": _B, "note": {"type": ["string", "null"]}}, required=["number", "lines"])},
               "Write a small invoice as JSON with a number like INV-00001 and its lines.",
               {"number": "INV-00001", "lines": [{"item": "pen", "qty": 2, "price": 1.5}], "paid": False}),
]
