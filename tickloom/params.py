"""``SamplingParams``: how a request samples and stops, validated when it is made.

The fields are declared once, in ``events.types.SamplingFields``; ``SamplingParams`` inherits them and adds only
validation (through ``tickloom.validation``, the public API's one boundary) and conversion to the logged
``SamplingSpec`` (see its docstring).
"""

from __future__ import annotations

import typing
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from tickloom.engine.errors import RequestRejected
from tickloom.events.types import (
    INT64_MAX,
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STRUCTURED_CHARS,
    Bias,
    Bound,
    SamplingFields,
    SamplingSpec,
    StopString,
    Structured,
    TokenId,
    TopLogprobs,
)
from tickloom.validation import checked, encodable_all, with_bounds

MAX_N = 128
_Text = Annotated[str, Meta(min_length=1, max_length=MAX_STRUCTURED_CHARS)]


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A structured-output constraint, as vLLM's ``StructuredOutputsParams``: set exactly one field.

    ``json`` is a JSON schema (a dict, or its JSON text); ``json_object`` any JSON object; ``regex`` a regular
    expression the whole output matches; ``choice`` one of these strings; ``grammar`` a Lark grammar, or a GBNF/EBNF
    one (llama.cpp's form, recognised by ``::=``). Logged as ``events.Structured`` (a schema as compact JSON);
    whether it compiles for the model's tokenizer is checked at submit, before anything is logged.
    """

    json: dict[str, Any] | _Text | None = None
    json_object: bool = False
    regex: _Text | None = None
    choice: Annotated[list[Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]],
                      Meta(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: _Text | None = None

    def to_wire(self) -> Structured:
        """The logged form; raises ``RequestRejected`` naming the field unless exactly one is set and well formed."""
        checked(msgspec.structs.asdict(self), StructuredOutputs, "SamplingParams.structured")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise RequestRejected(f"SamplingParams.structured: set exactly one of json, json_object, regex, choice, "
                                  f"grammar (got {', '.join(given) or 'none'})")
        if self.json is not None:
            schema: Any = self.json
            if isinstance(schema, str):
                try:
                    schema = msgspec.json.decode(schema)
                except msgspec.DecodeError as exc:
                    raise RequestRejected(f"SamplingParams.structured.json is not JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise RequestRejected("SamplingParams.structured.json must be a JSON schema object")
            text = msgspec.json.encode(schema).decode()  # compact; key order kept: the output's follows it
            if len(text) > MAX_STRUCTURED_CHARS:
                raise RequestRejected(f"SamplingParams.structured.json is {len(text)} characters as JSON, more than "
                                      f"{MAX_STRUCTURED_CHARS}")
            return Structured(kind="json", text=text)
        if self.json_object:
            return Structured(kind="json_object")
        if self.regex is not None:
            return Structured(kind="regex", text=self.regex)
        if self.choice is not None:
            return Structured(kind="choice", choices=list(self.choice))
        assert self.grammar is not None
        return Structured(kind="grammar", text=self.grammar)


class _PublicForms(SamplingFields, frozen=True, kw_only=True, array_like=False, gc=True, forbid_unknown_fields=True):
    """The declaration's fields (``events.types.SamplingFields``), with the public form of the three whose wire layout
    old logs pin, and the two that are not per-choice wire fields. Nothing else is declared here."""

    stop: StopString | Annotated[list[StopString], Bound(Meta(max_length=MAX_STOP_STRINGS))] = msgspec.field(  # type: ignore[assignment]
        default_factory=list)
    """Stop strings; a single ``str`` is one stop string (``stop="Paris"`` is ``stop=["Paris"]``)."""
    logprobs: TopLogprobs | None = None  # type: ignore[assignment]
    """None: no logprobs; k: each output token's logprob and its top-k alternatives (logged as ``logprobs`` and
    ``top_logprobs``)."""
    logit_bias: Annotated[dict[TokenId, Bias], Bound(Meta(max_length=MAX_LOGIT_BIAS))] = msgspec.field(  # type: ignore[assignment]
        default_factory=dict)
    """Token id -> a bias added to its logit before sampling (logged as ascending pairs)."""
    seed: Annotated[int, Bound(Meta(ge=0, le=INT64_MAX))] | None = None
    """None: the core assigns one (stable, logged), so even unseeded runs replay. Logged in the arrival."""
    n: Annotated[int, Bound(Meta(ge=1, le=MAX_N))] = 1
    """Parallel samples of the prompt: ``n`` requests that share its KV through the prefix cache."""
    structured: StructuredOutputs | None = None  # type: ignore[assignment]
    """The output must match this constraint (logged as ``events.Structured``)."""


def _mentions_token_ids(tp: Any) -> bool:
    if typing.get_origin(tp) is Annotated and any(isinstance(m, Bound) and m.token_ids for m in tp.__metadata__):
        return True
    return any(_mentions_token_ids(a) for a in typing.get_args(tp) if a is not Ellipsis)


_HINTS = typing.get_type_hints(_PublicForms, include_extras=True)
_FIELDS = _PublicForms.__struct_fields__
_Checked: type[Any] = msgspec.defstruct(
    "SamplingParams",
    [(f.name, with_bounds(_HINTS[f.name]), f.default if f.default_factory is msgspec.NODEFAULT
      else msgspec.field(default_factory=f.default_factory)) for f in msgspec.structs.fields(_PublicForms)],
    kw_only=True, forbid_unknown_fields=True,
)
"""What ``validate`` converts to: the public fields with their bounds enforced (built once, from the declaration)."""
_TOKEN_ID_FIELDS = tuple(name for name in _FIELDS if _mentions_token_ids(_HINTS[name]))
"""Fields holding token ids (a list of ids, or a map keyed by them): checked against the vocabulary at submit."""
_WIRE_FORMS = ("stop", "logprobs", "top_logprobs", "logit_bias", "allowed_token_ids", "structured")
"""Wire fields that ``to_spec`` converts; every other wire field is copied as it is."""


class SamplingParams(_PublicForms, frozen=True, kw_only=True, array_like=False, gc=True, forbid_unknown_fields=True):
    """Sampling and stopping, as in vLLM. ``temperature=0`` is greedy. Invalid values raise ``RequestRejected``.

    Every field is declared once, with its bound, in ``events.types.SamplingFields`` (``logprobs``, ``stop``,
    ``logit_bias``, ``seed`` and ``n`` in their public form above). Across fields: ``min_tokens`` at most
    ``max_tokens``; with a ``seed``, ``seed + n - 1`` below 2**63 (choice i is seeded ``seed + i``); token ids
    inside the model's vocabulary (checked at submit). ``top_logprobs`` only mirrors ``logprobs`` (the log's form:
    set ``logprobs=k``). Values are normalised as they are checked: a ``str`` stop becomes a one-element list, ints
    given for floats become floats, and the lists and maps are the params' own copies.

    Sampling applies, per row: penalties, ``logit_bias``, the ``allowed_token_ids`` mask, the ``min_tokens``
    mask of EOS and ``stop_token_ids``, then greedy argmax or temperature and the filters. Logprobs are those of
    this processed distribution, before temperature (``engine.model.sampling``).
    """

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field again (``Engine`` calls this at submit: the lists are mutable)."""
        fields: Any = checked(msgspec.structs.asdict(self), _Checked, "SamplingParams")
        stop = [fields.stop] if isinstance(fields.stop, str) else fields.stop
        encodable_all(stop, "SamplingParams.stop")
        if fields.min_tokens > fields.max_tokens:
            raise RequestRejected(f"SamplingParams.min_tokens={fields.min_tokens} must not exceed "
                                  f"max_tokens={fields.max_tokens}")
        if fields.seed is not None and fields.seed + fields.n - 1 > INT64_MAX:
            raise RequestRejected(f"SamplingParams.seed={fields.seed} with n={fields.n}: choice i is seeded seed + i, "
                                  f"which must stay below 2**63")
        if fields.structured is not None:
            fields.structured.to_wire()
            if fields.ignore_eos:
                raise RequestRejected("SamplingParams.ignore_eos cannot be combined with structured: a constraint "
                                      "ends the output with EOS")
        if fields.top_logprobs not in (0, fields.logprobs or 0):
            raise RequestRejected(f"SamplingParams.top_logprobs={fields.top_logprobs} only mirrors logprobs="
                                  f"{fields.logprobs}: set logprobs=k for k top logprobs")
        values = {**{name: getattr(fields, name) for name in _FIELDS}, "stop": stop,
                  "top_logprobs": fields.logprobs or 0}
        for name, value in values.items():
            if getattr(self, name) is not value:
                msgspec.structs.force_setattr(self, name, value)

    def to_spec(self) -> SamplingSpec:
        """The logged wire form (the seed travels separately, in the arrival; ``n`` is the number of arrivals).

        Every wire field is copied (lists as the spec's own copies), but for the public forms: ``stop`` a list,
        ``logprobs`` a flag and ``top_logprobs`` its count, ``logit_bias`` ascending pairs, ``allowed_token_ids``
        ascending and unique (so equal params log equal bytes).
        """
        values = {name: _copy(getattr(self, name)) for name in SamplingSpec.__struct_fields__
                  if name not in _WIRE_FORMS}
        allowed = self.allowed_token_ids
        return SamplingSpec(
            **values, stop=[self.stop] if isinstance(self.stop, str) else list(self.stop),
            logprobs=self.logprobs is not None, top_logprobs=self.logprobs or 0,
            logit_bias=sorted(self.logit_bias.items()),
            allowed_token_ids=None if allowed is None else sorted(set(allowed)),
            structured=None if self.structured is None else self.structured.to_wire(),
        )

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse token ids at or beyond ``vocab_size`` (``Engine`` calls this at submit, when it is known)."""
        for name in _TOKEN_ID_FIELDS:
            ids = getattr(self, name) or ()
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise RequestRejected(f"SamplingParams.{name} contains {bad}, outside vocab_size={vocab_size}")


def _copy(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value
