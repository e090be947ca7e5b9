"""Shared value types of the vocabulary: the sampling fields (declared once), usage and finish reasons.

Every Struct in ``events`` is frozen, ``array_like`` (encoded as a msgpack array, so field order is part of the
schema: append new fields at the end, always with a default) and ``gc=False`` (none can form a cycle).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

FinishReason = Literal["stop", "length", "timeout", "cancelled", "error"]
"""Why a request ended. Precedence when several apply at one token: timeout > cancelled > stop > length > error."""

FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "timeout", "cancelled", "error")


class Record(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Base class of every logged Struct."""


INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT_MAX = sys.float_info.max
"""An upper bound that rejects ``inf`` (and, as every bound does, NaN): a float field's bounds make it finite."""
MAX_TOKENS = 2**31
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 2**18
"""Entries of ``logit_bias`` and ``allowed_token_ids`` at most: above any vocabulary's size."""
MAX_BIAS = 100.0
"""``logit_bias`` values lie in [-MAX_BIAS, MAX_BIAS], as in OpenAI's API."""
MAX_STRUCTURED_CHARS = 2**20
"""A constraint's text (a JSON schema, a regex, a grammar) is at most 1 MiB."""
MAX_CHOICES = 1024
"""A ``choice`` constraint lists at most this many strings."""

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]
"""What a constraint's ``text`` holds: a JSON schema, nothing (any JSON object), a regex, nothing (the ``choices``
are the constraint) or a grammar (Lark, or GBNF/EBNF when it uses ``::=``)."""


class Structured(Record, frozen=True, kw_only=True):
    """A structured-output constraint as logged: the output must match it (``SamplingSpec.structured``).

    The grammar engine compiles it on the device side; the core never reads it. Its checks (the text parses and
    compiles for the model's tokenizer) run where the public API converts it, before anything is logged.
    """

    kind: StructuredKind
    text: str = ""
    """The JSON schema (compact JSON, keys in the order given: the output's properties follow it), the regex or the
    grammar; "" for the others."""
    choices: list[str] = []
    """The strings a ``choice`` constraint allows, in the order given."""


@dataclass(frozen=True, slots=True)
class Bound:
    """A field's bound, checked where the public API takes the value (``tickloom.params``), never when a log is read.

    msgspec ignores this marker, so decoding a log accepts any value of the field's type: the core sees what was
    logged, refuses a bad request itself (with a logged ``Finish(error)``), and a log holding such a refusal still
    reads and replays. ``token_ids`` marks a field of token ids, checked against the vocabulary at submit.
    """

    meta: msgspec.Meta
    token_ids: bool = False


Count = Annotated[int, Bound(msgspec.Meta(ge=0, le=MAX_TOKENS))]
TokenId = Annotated[int, Bound(msgspec.Meta(ge=0, le=INT32_MAX), token_ids=True)]
"""A token id's range on the wire; the vocabulary bound is checked where the vocabulary is known (``Engine``)."""
StopString = Annotated[str, Bound(msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS))]
Bias = Annotated[float, Bound(msgspec.Meta(ge=-MAX_BIAS, le=MAX_BIAS))]
TopLogprobs = Annotated[int, Bound(msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS))]


class SamplingFields(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """The one declaration of how a request samples and stops: each field's name, type, bound and default.

    ``SamplingSpec`` is this on the wire (logged, read by the core, the sampler and the retire actor). The public
    ``SamplingParams`` inherits it and adds only validation (the ``Bound`` markers, checked by ``msgspec.convert``)
    and conversion: the vLLM forms of ``stop`` (a str too), ``logprobs`` (None or k, logged as ``logprobs`` and
    ``top_logprobs``) and ``logit_bias`` (a map, logged as pairs), whose wire layout old logs pin, plus ``n`` and
    ``seed``. A new field goes here, at the end, with a default (the fields' order is the log's layout); it is then
    a ``SamplingParams`` argument, validated, logged and replayed with no other change.
    """

    max_tokens: Annotated[int, Bound(msgspec.Meta(ge=1, le=MAX_TOKENS))] = 16
    """Output tokens at most."""
    min_tokens: Count = 0
    """EOS and ``stop_token_ids`` are masked until this many output tokens (at most ``max_tokens``)."""
    temperature: Annotated[float, Bound(msgspec.Meta(ge=0.0, le=FLOAT_MAX))] = 1.0
    """0 (or below 1e-5) is greedy."""
    top_k: Count = 0
    """0 disables top-k."""
    top_p: Annotated[float, Bound(msgspec.Meta(gt=0.0, le=1.0))] = 1.0
    min_p: Annotated[float, Bound(msgspec.Meta(ge=0.0, le=1.0))] = 0.0
    repetition_penalty: Annotated[float, Bound(msgspec.Meta(gt=0.0, le=FLOAT_MAX))] = 1.0
    presence_penalty: Annotated[float, Bound(msgspec.Meta(ge=-2.0, le=2.0))] = 0.0
    frequency_penalty: Annotated[float, Bound(msgspec.Meta(ge=-2.0, le=2.0))] = 0.0
    stop: Annotated[list[StopString], Bound(msgspec.Meta(max_length=MAX_STOP_STRINGS))] = []
    """Stop strings, matched on the output text by the retire actor."""
    stop_token_ids: Annotated[list[TokenId], Bound(msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS))] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: bool = False
    """Each output token's logprob (the wire form; ``SamplingParams.logprobs`` is None or the top-k count)."""
    top_logprobs: TopLogprobs = 0
    """The top-k alternatives' logprobs per output token (with ``logprobs``)."""
    thinking_budget: Count | None = None
    """Reasoning tokens at most, then the think-end token is forced (a tickloom extension)."""
    skip_special_tokens: bool = True
    logit_bias: Annotated[list[tuple[TokenId, Bias]], Bound(msgspec.Meta(max_length=MAX_LOGIT_BIAS))] = []
    """(token id, bias) pairs, ids ascending and unique: the bias is added to that token's logit before sampling.
    Pairs, not a map: the log's deterministic encoding takes only str map keys."""
    allowed_token_ids: (Annotated[list[TokenId], Bound(msgspec.Meta(min_length=1, max_length=MAX_LOGIT_BIAS))]
                        | None) = None
    """Only these tokens may be sampled (None: any); ascending and unique on the wire."""
    prompt_logprobs: TopLogprobs | None = None
    """None: none; k: each prompt token's logprob (from position 1) and the top-k alternatives, once."""
    truncate_prompt_tokens: Annotated[int, Bound(msgspec.Meta(ge=-1, le=MAX_TOKENS))] | None = None
    """Keep only the prompt's last k tokens (left truncation, as in vLLM); -1: the last ``max_seq_len - 1``; None:
    the whole prompt. The arrival logs the kept tokens."""
    structured: Structured | None = None
    """The output must match this constraint (None: unconstrained). EOS is masked until the constraint may end; when
    it must end the request finishes with ``stop``, and ``length`` leaves a valid prefix."""


class SamplingSpec(SamplingFields, Record, frozen=True, kw_only=True):
    """How one request samples and stops, as logged: the fields of ``SamplingFields``."""


class Usage(Record, frozen=True):
    """Token counts of a finished request."""

    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0


class CoreGauges(Record, frozen=True):
    """A few state counters, logged with every tick and folded into the digest."""

    waiting: int
    running: int
    preempted: int
    swapped: int
    free_blocks: int
    cached_blocks: int
