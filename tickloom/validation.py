"""The public API's one validation boundary: every value a caller hands tickloom (a request's arguments, its
``SamplingParams``, an ``EngineConfig``) is converted here before anything else sees it.

``checked`` refuses strings UTF-8 cannot encode, then converts a value with msgspec (``msgspec.convert`` enforces
the ``Annotated[..., Meta(...)]`` bounds that plain construction does not; ``with_bounds`` turns the declaration's
``Bound`` markers into such ``Meta``) and raises ``RequestRejected`` (or ``ConfigError``) naming the field, through
the core's ``converted``.

Bounds follow what the log encodes and the core computes with: every int fits msgpack's int64 (most are far
tighter), every float is finite, every string encodes as UTF-8 (a lone surrogate would make the log unwritable).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable
from typing import Annotated, Any, TypeVar

from tickloom.engine.core.config import converted
from tickloom.engine.errors import RequestRejected
from tickloom.events.types import Bound

T = TypeVar("T")

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


def checked(value: Any, type_: type[T] | Any, what: str, error: type[ValueError] = RequestRejected) -> T:
    """``msgspec.convert(value, type_)`` (strict: no bool for int, no str for numbers), errors as ``error``.

    The message starts with ``what`` (the parameter or struct) and keeps msgspec's path, e.g.
    ``SamplingParams: Expected `int` >= 1 - at `$.max_tokens```.
    """
    bad = unencodable(value, "")
    if bad is not None:  # msgspec.convert itself raises UnicodeEncodeError on a lone surrogate
        raise error(f"{what}{bad} is not encodable as UTF-8 (a lone surrogate)")
    result: T = converted(value, type_, what, error)
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


def encodable(value: str, what: str, error: type[ValueError] = RequestRejected) -> None:
    """Refuse a string that UTF-8 cannot encode (lone surrogates such as ``"\\ud800"``): the log could not hold it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(f"{what} is not encodable as UTF-8 ({exc.reason} at index {exc.start})") from None


def encodable_all(values: Iterable[str], what: str, error: type[ValueError] = RequestRejected) -> None:
    for i, value in enumerate(values):
        encodable(value, f"{what}[{i}]", error)


def with_bounds(tp: Any) -> Any:
    """``tp`` with every ``Bound`` marker replaced by its ``Meta``, so that ``msgspec.convert`` checks it."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        extras = [m.meta if isinstance(m, Bound) else m for m in tp.__metadata__]
        return Annotated[(with_bounds(args[0]), *extras)]
    if not args:
        return tp
    converted_args = tuple(a if a is Ellipsis else with_bounds(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return typing.Union[converted_args]  # noqa: UP007 (built from a tuple)
    return origin[converted_args]
