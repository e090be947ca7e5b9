"""Hypothesis strategies for every vocabulary type, derived from msgspec's own view of each field's type.

Deriving them from ``msgspec.inspect`` means a field added to the vocabulary is generated without touching this
file. Integers stay in msgpack's range; floats are finite or infinite but never NaN (NaN != NaN).
"""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st

INT64_MIN = -(2**63)
UINT64_MAX = 2**64 - 1

_ints = st.integers(INT64_MIN, UINT64_MAX)
_floats = st.floats(allow_nan=False)
_text = st.text(max_size=12)


def strategy_for(t: Any) -> st.SearchStrategy[Any]:
    """A strategy for a type: a Python type or annotation (``Input``, ``list[int]``...) or a msgspec Type."""
    return _from_info(t if isinstance(t, mi.Type) else mi.type_info(t))


_struct_cache: dict[type, st.SearchStrategy[Any]] = {}


def _from_info(info: mi.Type) -> st.SearchStrategy[Any]:
    if isinstance(info, mi.StructType):
        cls = info.cls
        if cls not in _struct_cache:
            fields = {f.name: _from_info(f.type) for f in info.fields}
            _struct_cache[cls] = st.fixed_dictionaries(fields).map(lambda kw, cls=cls: cls(**kw))
        return _struct_cache[cls]
    if isinstance(info, mi.UnionType):
        return st.one_of([_from_info(t) for t in info.types])
    if isinstance(info, mi.ListType):
        return st.lists(_from_info(info.item_type), max_size=5)
    if isinstance(info, mi.DictType):
        return st.dictionaries(_from_info(info.key_type), _from_info(info.value_type), max_size=5)
    if isinstance(info, mi.TupleType):
        return st.tuples(*(_from_info(t) for t in info.item_types))
    if isinstance(info, mi.LiteralType):
        return st.sampled_from(info.values)
    if isinstance(info, mi.IntType):
        return _ints
    if isinstance(info, mi.FloatType):
        return _floats
    if isinstance(info, mi.StrType):
        return _text
    if isinstance(info, mi.BoolType):
        return st.booleans()
    if isinstance(info, mi.BytesType):
        return st.binary(max_size=20)
    if isinstance(info, mi.NoneType):
        return st.none()
    if isinstance(info, mi.RawType):
        return st.just(msgspec.Raw(b"\xc0"))
    raise TypeError(f"no strategy for {info!r}: extend tests/strategies.py")
