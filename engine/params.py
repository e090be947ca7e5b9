"""``SamplingParams``: how a request samples and stops, validated when it is made.

This module is also the one validation boundary of the public API: ``checked`` converts a value with msgspec
(``msgspec.convert`` enforces the ``Annotated[..., Meta(...)]`` bounds that plain construction does not) and
turns a ``msgspec.ValidationError`` into ``RequestRejected`` (or ``ConfigError``), keeping msgspec's
``at `$.field` `` path, so every message names the field. ``Engine`` and ``EngineConfig`` use the same helpers.

Bounds follow what the log encodes and the core computes with: every int fits msgpack's int64 (most are far
tighter), every float is finite, every string encodes as UTF-8 (a lone surrogate would make the log unwritable).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from tickloom.engine.errors import RequestRejected
from tickloom.events import SamplingSpec

T = TypeVar("T")

INT32_MIN = -(2**31)
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
MAX_N = 128

Count = Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
"""A token id's range on the wire; the vocabulary bound is checked where the vocabulary is known (``Engine``)."""
Bias = Annotated[float, Meta(ge=-MAX_BIAS, le=MAX_BIAS)]


def checked(value: Any, type_: type[T] | Any, what: str, error: type[ValueError] = RequestRejected) -> T:
    """``msgspec.convert(value, type_)`` (strict: no bool for int, no str for numbers), errors as ``error``.

    The message starts with ``what`` (the parameter or struct) and keeps msgspec's path, e.g.
    ``SamplingParams: Expected `int` >= 1 - at `$.max_tokens```.
    """
    bad = unencodable(value, "")
    if bad is not None:  # msgspec.convert itself raises UnicodeEncodeError on a lone surrogate
        raise error(f"{what}{bad} is not encodable as UTF-8 (a lone surrogate)")
    try:
        result: T = msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        found = _PATH.search(str(exc))
        if found is not None and isinstance(value, dict) and found.group(1) in value:
            name = found.group(1)
            raise error(f"{what}.{name}={_short(value[name])}: {exc}") from None
        raise error(f"{what}: {exc}") from None
    return result


def unencodable(value: Any, path: str = "", depth: int = 0) -> str | None:
    """The path (``.field``, ``[i]``) of the first string in ``value`` that UTF-8 cannot encode, if any.

    Containers deeper than any accepted type are not searched: msgspec rejects their shape first.
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if depth >= 8:
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            sub = f".{key}" if isinstance(key, str) and path == "" and key.isidentifier() else f"[{key!r}]"
            found = unencodable(key, path + sub, depth + 1) or unencodable(item, path + sub, depth + 1)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, item in enumerate(value):
            found = unencodable(item, f"{path}[{i}]", depth + 1)
            if found is not None:
                return found
    return None


_PATH = re.compile(r"(?:at|in) `\$\.([A-Za-z_][A-Za-z0-9_]*)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def encodable(value: str, what: str, error: type[ValueError] = RequestRejected) -> None:
    """Refuse a string that UTF-8 cannot encode (lone surrogates such as ``"\\ud800"``): the log could not hold it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(f"{what} is not encodable as UTF-8 ({exc.reason} at index {exc.start})") from None


def encodable_all(values: Iterable[str], what: str, error: type[ValueError] = RequestRejected) -> None:
    for i, value in enumerate(values):
        encodable(value, f"{what}[{i}]", error)


class _SamplingFields(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of ``SamplingParams`` with their bounds (``msgspec.convert`` checks them; nothing else does)."""

    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] = 16
    min_tokens: Count = 0
    temperature: Annotated[float, Meta(ge=0.0, le=FLOAT_MAX)] = 1.0
    top_k: Count = 0
    """0 disables top-k."""
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=FLOAT_MAX)] = 1.0
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    seed: Annotated[int, Meta(ge=0, le=INT64_MAX)] | None = None
    """None: the core assigns one (stable, logged), so even unseeded runs replay."""
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] = []
    """Stop strings; a single ``str`` is one stop string (``stop="Paris"`` is ``stop=["Paris"]``)."""
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """None: no logprobs; k: each output token's logprob and its top-k alternatives."""
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    """None: none; k: each prompt token's logprob and its top-k alternatives, on the first frame."""
    thinking_budget: Count | None = None
    skip_special_tokens: bool = True
    logit_bias: Annotated[dict[TokenId, Bias], Meta(max_length=MAX_LOGIT_BIAS)] = {}
    """Token id -> a bias added to its logit before sampling."""
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_LOGIT_BIAS)] | None = None
    """Only these tokens may be sampled; None: any."""
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    """Parallel samples of the prompt: ``n`` requests that share its KV through the prefix cache."""


class SamplingParams(_SamplingFields, frozen=True, kw_only=True):
    """Sampling and stopping, as in vLLM. ``temperature=0`` is greedy. Invalid values raise ``RequestRejected``.

    Bounds: ``max_tokens`` in [1, 2**31]; ``min_tokens`` in [0, max_tokens]; ``temperature`` finite, >= 0;
    ``top_k`` in [0, 2**31] (0: off); ``top_p`` in (0, 1]; ``min_p`` in [0, 1]; ``repetition_penalty`` finite,
    > 0; presence and frequency penalties in [-2, 2]; ``seed`` in [0, 2**63); ``stop`` a string or at most 128
    non-empty strings of at most 1024 characters; ``stop_token_ids`` at most 1024 ids inside the model's
    vocabulary (checked at submit); ``logprobs`` and ``prompt_logprobs`` None or in [0, 20]; ``thinking_budget``
    None or in [0, 2**31]; ``logit_bias`` ids inside the vocabulary (checked at submit), biases in [-100, 100];
    ``allowed_token_ids`` None or 1 to 2**18 ids inside the vocabulary (checked at submit); ``n`` in [1, 128],
    and with a ``seed``, ``seed + n - 1`` below 2**63 (choice i is seeded ``seed + i``).
    Values are normalised as they are checked: a ``str`` stop becomes a one-element list, ints given for floats
    become floats, and the lists and maps are the params' own copies.

    Sampling applies, per row: penalties, ``logit_bias``, the ``allowed_token_ids`` mask, the ``min_tokens``
    mask of EOS and ``stop_token_ids``, then greedy argmax or temperature and the filters. Logprobs are those of
    this processed distribution, before temperature (``engine.model.sampling``).
    """

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field again (``Engine`` calls this at submit: the lists are mutable)."""
        fields: _SamplingFields = checked(msgspec.structs.asdict(self), _SamplingFields, "SamplingParams")
        stop = [fields.stop] if isinstance(fields.stop, str) else fields.stop
        encodable_all(stop, "SamplingParams.stop")
        if fields.min_tokens > fields.max_tokens:
            raise RequestRejected(f"SamplingParams.min_tokens={fields.min_tokens} must not exceed "
                                  f"max_tokens={fields.max_tokens}")
        if fields.seed is not None and fields.seed + fields.n - 1 > INT64_MAX:
            raise RequestRejected(f"SamplingParams.seed={fields.seed} with n={fields.n}: choice i is seeded seed + i, "
                                  f"which must stay below 2**63")
        for name in _SamplingFields.__struct_fields__:  # not msgspec.structs.fields: it re-evaluates annotations
            value = stop if name == "stop" else getattr(fields, name)
            if getattr(self, name) is not value:
                msgspec.structs.force_setattr(self, name, value)

    def to_spec(self) -> SamplingSpec:
        """The logged wire form (the seed travels separately, in the arrival; ``n`` is the number of arrivals).

        Floats are made floats: ``temperature=0`` would otherwise encode as an int, decode as 0.0 and re-encode
        to other bytes, so a replay's digest would differ from the live run's.
        """
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        allowed = None if self.allowed_token_ids is None else sorted({int(t) for t in self.allowed_token_ids})
        return SamplingSpec(
            max_tokens=int(self.max_tokens), min_tokens=int(self.min_tokens), temperature=float(self.temperature),
            top_k=int(self.top_k), top_p=float(self.top_p), min_p=float(self.min_p),
            repetition_penalty=float(self.repetition_penalty), presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty), stop=stop,
            stop_token_ids=[int(t) for t in self.stop_token_ids],
            include_stop_str=bool(self.include_stop_str_in_output), ignore_eos=bool(self.ignore_eos),
            logprobs=self.logprobs is not None, top_logprobs=int(self.logprobs or 0),
            thinking_budget=None if self.thinking_budget is None else int(self.thinking_budget),
            skip_special_tokens=bool(self.skip_special_tokens),
            logit_bias=[(int(t), float(b)) for t, b in sorted(self.logit_bias.items())],
            allowed_token_ids=allowed,
            prompt_logprobs=None if self.prompt_logprobs is None else int(self.prompt_logprobs),
        )

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse token ids at or beyond ``vocab_size`` (``Engine`` calls this at submit, when it is known)."""
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            ids = getattr(self, name) or ()
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise RequestRejected(f"SamplingParams.{name} contains {bad}, outside vocab_size={vocab_size}")
