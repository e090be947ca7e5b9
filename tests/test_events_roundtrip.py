"""Every vocabulary type survives encode -> decode unchanged, with every field generated."""

from __future__ import annotations

import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import strategy_for

from tickloom import events
from tickloom.events import (
    COMMAND_TYPES,
    INPUT_TYPES,
    Command,
    CoreGauges,
    Frame,
    Input,
    LogHeader,
    SamplingSpec,
    SnapshotRecord,
    Structured,
    TickInputs,
    TickOutputs,
    TickRecord,
    Usage,
    decode_commands,
    decode_frame,
    encode,
    encode_commands,
    encode_tick,
)
from tickloom.events.codec import encode_tick_into

RECORD_TYPES = (SamplingSpec, Structured, Usage, CoreGauges, TickInputs, TickOutputs, TickRecord, SnapshotRecord,
                LogHeader)
ALL_TYPES = INPUT_TYPES + COMMAND_TYPES + RECORD_TYPES


def test_type_tuples_cover_the_unions() -> None:
    assert set(typing.get_args(Input)) == set(INPUT_TYPES)
    assert set(typing.get_args(Command)) == set(COMMAND_TYPES)
    assert len(INPUT_TYPES) == len(set(INPUT_TYPES))
    assert len(COMMAND_TYPES) == len(set(COMMAND_TYPES))


def test_every_record_type_is_exported_and_tested() -> None:
    """A new Struct in ``events`` must be added to a union or to RECORD_TYPES here, so it gets round-tripped."""
    exported = {v for v in vars(events).values() if isinstance(v, type) and issubclass(v, msgspec.Struct)}
    assert exported - {events.Record} == set(ALL_TYPES)


def test_tags_are_unique_and_pinned() -> None:
    tags = [msgspec.inspect.type_info(t).tag for t in INPUT_TYPES + COMMAND_TYPES]
    assert all(isinstance(t, str) and t for t in tags)
    assert len(tags) == len(set(tags))


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip(cls: type, data: st.DataObject) -> None:
    value = data.draw(strategy_for(cls))
    assert msgspec.msgpack.decode(encode(value), type=cls) == value


@settings(max_examples=40, deadline=None)
@given(value=strategy_for(Input))
def test_input_round_trips_through_the_union(value: Input) -> None:
    assert msgspec.msgpack.decode(encode(value), type=Input) == value


@settings(max_examples=40, deadline=None)
@given(commands=strategy_for(list[Command]))
def test_commands_round_trip(commands: list[Command]) -> None:
    assert decode_commands(encode_commands(commands)) == commands


@settings(max_examples=40, deadline=None)
@given(frame=strategy_for(Frame))
def test_frames_round_trip(frame: Frame) -> None:
    assert decode_frame(encode(frame)) == frame


@settings(max_examples=60, deadline=None)
@given(inputs=strategy_for(TickInputs), outputs=strategy_for(TickOutputs))
def test_encode_tick_equals_encoding_the_record(inputs: TickInputs, outputs: TickOutputs) -> None:
    expected = encode(TickRecord(inputs, outputs))
    assert encode_tick(inputs, outputs) == expected
    assert encode_tick(inputs, outputs, encode_commands(outputs.commands)) == expected
    assert decode_frame(expected) == TickRecord(inputs, outputs)
    for encoded in (None, encode_commands(outputs.commands)):
        buf = bytearray(b"prefix")
        encode_tick_into(buf, inputs, outputs, encoded)
        assert bytes(buf) == b"prefix" + expected
