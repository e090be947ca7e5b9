"""Old logs stay readable: checked-in fixtures, the append-only schema list, and a field added with a default."""

# No ``from __future__ import annotations`` here: the variant Structs below need their annotations evaluated.
import typing
from pathlib import Path

import msgspec
from fixtures.make_fixture import HEADER, SNAPSHOT_AFTER, fixture_snapshot, fixture_ticks

from tickloom.events import (
    COMMAND_TYPES,
    INPUT_TYPES,
    SCHEMA_HASH,
    LogHeader,
    LogReader,
    Record,
    RequestCancelled,
    SnapshotRecord,
    TickOutputs,
    TickRecord,
    known_schema_hashes,
)
from tickloom.events.codec import compute_schema_hash

FIXTURES = Path(__file__).parent / "fixtures"
FIRST_FIXTURE = FIXTURES / "schema-b8fe84d3a48d82d15beff94d.tlog"


def _fixtures() -> list[Path]:
    found = sorted(FIXTURES.glob("schema-*.tlog"))
    assert FIRST_FIXTURE in found
    return found


def test_current_schema_is_known() -> None:
    assert compute_schema_hash() == SCHEMA_HASH
    assert SCHEMA_HASH in known_schema_hashes()


def test_every_fixture_schema_is_still_listed() -> None:
    """known_schemas.txt is append-only: a hash that has a fixture may never leave it."""
    known = known_schema_hashes()
    for path in _fixtures():
        with LogReader(path) as reader:
            assert reader.header.schema_hash == path.stem.removeprefix("schema-")
            assert reader.header.schema_hash in known


def test_a_fixture_exists_for_the_current_schema() -> None:
    assert FIXTURES / f"schema-{SCHEMA_HASH}.tlog" in _fixtures(), "run tests/fixtures/make_fixture.py once"


def test_fixture_covers_every_input_and_command_type() -> None:
    ticks = fixture_ticks()
    inputs = {type(i) for t in ticks for i in t.inputs.inputs}
    commands = {type(c) for t in ticks for c in t.outputs.commands}
    assert inputs == set(INPUT_TYPES)
    assert commands == set(COMMAND_TYPES)


def _undigested(outputs: TickOutputs) -> TickOutputs:
    """Digests hash the encoded commands, whose bytes change with the schema: compare everything else."""
    return msgspec.structs.replace(outputs, digest=b"")


def _undigested_ticks(ticks: list[TickRecord]) -> list[TickRecord]:
    return [TickRecord(t.inputs, _undigested(t.outputs)) for t in ticks]


def test_fixtures_read_back_equal() -> None:
    for path in _fixtures():
        with LogReader(path) as reader:
            assert reader.header == msgspec.structs.replace(HEADER, schema_hash=reader.header.schema_hash)
            records = list(reader.records())
            assert reader.tail.torn_bytes == 0
        ticks = [r for r in records if isinstance(r, TickRecord)]
        snapshots = [r for r in records if isinstance(r, SnapshotRecord)]
        assert _undigested_ticks(ticks) == _undigested_ticks(fixture_ticks())
        assert [msgspec.structs.replace(s, digest=b"") for s in snapshots] == [
            msgspec.structs.replace(fixture_snapshot(), digest=b"")
        ]
        assert records.index(snapshots[0]) == SNAPSHOT_AFTER + 1


# A later vocabulary: RequestCancelled gains a trailing field with a default (the allowed kind of change). Old logs
# must decode with it, the new field taking its default.
class RequestCancelledV2(Record, frozen=True, tag="cancel"):
    request_id: str
    reason: str = "client asked"


InputV2 = typing.Union[tuple(RequestCancelledV2 if t is RequestCancelled else t for t in INPUT_TYPES)]  # type: ignore[valid-type]  # noqa: UP007


class TickInputsV2(Record, frozen=True):
    tick: int
    now_ns: int
    inputs: list[InputV2]  # type: ignore[valid-type]


class TickRecordV2(Record, frozen=True, tag="tick"):
    inputs: TickInputsV2
    outputs: TickOutputs


FrameV2 = LogHeader | TickRecordV2 | SnapshotRecord


def test_fixture_reads_with_a_field_added_with_a_default() -> None:
    decoder = msgspec.msgpack.Decoder(FrameV2)
    for path in _fixtures():
        data = path.read_bytes()
        with LogReader(path) as reader:
            infos = [i for i in reader.frames() if i.kind == "tick"]
        decoded = [decoder.decode(data[i.payload_offset : i.end]) for i in infos]
        expected = fixture_ticks()
        assert len(decoded) == len(expected)
        saw_cancel = False
        for new, old in zip(decoded, expected, strict=True):
            assert isinstance(new, TickRecordV2)
            assert _undigested(new.outputs) == _undigested(old.outputs)
            assert new.inputs.tick == old.inputs.tick
            for new_input, old_input in zip(new.inputs.inputs, old.inputs.inputs, strict=True):
                if isinstance(old_input, RequestCancelled):
                    assert new_input == RequestCancelledV2(old_input.request_id, "client asked")
                    saw_cancel = True
                else:
                    assert new_input == old_input
        assert saw_cancel
