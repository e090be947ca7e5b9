"""The log file: framing, torn-tail recovery, corruption, limits, compatibility, permissions and seek."""

from __future__ import annotations

import os
import shutil
import struct
import zlib
from pathlib import Path

import msgspec
import pytest
from fixtures.make_fixture import HEADER, fixture_ticks

from tickloom.events import (
    FORMAT_VERSION,
    SCHEMA_HASH,
    LogCorrupt,
    LogError,
    LogFrameTooLarge,
    LogIncompatible,
    LogReader,
    LogWriter,
    SnapshotRecord,
    TickRecord,
    encode,
    encode_commands,
    encode_tick,
    recover_log,
)
from tickloom.events.frames import HEADER_SIZE, MAGIC, FrameInfo, pack_frame


def write_log(path: Path, ticks: list[TickRecord] | None = None, *, snapshot_every: int = 0) -> list[TickRecord]:
    ticks = fixture_ticks() if ticks is None else ticks
    with LogWriter(path, HEADER) as writer:
        for record in ticks:
            writer.append_tick(record.inputs, record.outputs)
            if snapshot_every and record.inputs.tick % snapshot_every == snapshot_every - 1:
                writer.append_snapshot(SnapshotRecord(record.inputs.tick, record.outputs.digest, b"state"))
    return ticks


def many_ticks(n: int) -> list[TickRecord]:
    base = fixture_ticks()
    return [
        msgspec.structs.replace(
            base[i % len(base)],
            inputs=msgspec.structs.replace(base[i % len(base)].inputs, tick=i),
            outputs=msgspec.structs.replace(base[i % len(base)].outputs, tick=i),
        )
        for i in range(n)
    ]


def frame_infos(path: Path) -> tuple[FrameInfo, list[FrameInfo]]:
    """The header frame's extent and every later frame."""
    with LogReader(path) as reader:
        frames = list(reader.frames())
        first = reader._first_frame_offset
    return FrameInfo("header", 0, 0, first - HEADER_SIZE), frames


def test_writes_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    ticks = write_log(path)
    with LogReader(path) as reader:
        assert reader.header == HEADER
        assert list(reader.ticks()) == ticks
        assert reader.tail.torn_bytes == 0
        assert reader.tail.end_offset == path.stat().st_size


def test_frames_are_pack_frame_bytes(tmp_path: Path) -> None:
    """The writer's zero-copy framing builds exactly ``pack_frame``'s bytes."""
    path = tmp_path / "a.tlog"
    ticks = write_log(path)
    expected = pack_frame("header", 0, encode(HEADER)) + b"".join(
        pack_frame("tick", t.inputs.tick, encode(t)) for t in ticks
    )
    assert path.read_bytes() == expected


def test_pre_encoded_commands_give_the_same_file(tmp_path: Path) -> None:
    ticks = fixture_ticks()
    write_log(tmp_path / "a.tlog", ticks)
    with LogWriter(tmp_path / "b.tlog", HEADER) as writer:
        for t in ticks:
            writer.append_tick(t.inputs, t.outputs, encode_commands(t.outputs.commands))
    assert (tmp_path / "a.tlog").read_bytes() == (tmp_path / "b.tlog").read_bytes()


def test_failed_encode_leaves_no_partial_frame(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    good = fixture_ticks()[0]
    with LogWriter(path, HEADER) as writer:
        writer.append_tick(good.inputs, good.outputs)
        with pytest.raises(TypeError):
            writer.append_tick(good.inputs, good.outputs, encoded_commands=object())  # type: ignore[arg-type]
        writer.append_tick(good.inputs, good.outputs)
    with LogReader(path) as reader:
        assert list(reader.ticks()) == [good, good]


def test_log_files_are_private(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_log(tmp_path / "a.tlog")
    finally:
        os.umask(old)
    assert (tmp_path / "a.tlog").stat().st_mode & 0o777 == 0o600


def test_writer_never_clobbers(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    write_log(path)
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="never overwrites"):
        LogWriter(path, HEADER)
    assert path.read_bytes() == before


def test_write_after_close_raises(tmp_path: Path) -> None:
    writer = LogWriter(tmp_path / "a.tlog", HEADER)
    writer.close()
    writer.close()  # idempotent
    t = fixture_ticks()[0]
    writer.append_tick(t.inputs, t.outputs)
    with pytest.raises(LogError, match="closed"):
        writer.flush()


def test_torn_tail_at_every_offset_of_the_last_frame(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    ticks = write_log(path)
    data = path.read_bytes()
    _, frames = frame_infos(path)
    last = frames[-1]
    assert last.end == len(data)
    torn = tmp_path / "torn.tlog"
    for cut in range(last.offset, last.end):
        torn.write_bytes(data[:cut])
        with LogReader(torn) as reader:
            assert list(reader.ticks()) == ticks[:-1], cut
            assert reader.tail.torn_bytes == cut - last.offset
        recovery = recover_log(torn)
        assert recovery.bytes_dropped == cut - last.offset
        assert recovery.frames == len(frames) - 1
        assert recovery.last_tick == frames[-2].tick
        assert torn.read_bytes() == data[: last.offset]
    # A whole log needs no recovery.
    recovery = recover_log(path)
    assert (recovery.bytes_dropped, recovery.frames, recovery.last_tick) == (0, len(frames), ticks[-1].inputs.tick)


def test_a_damaged_final_frame_is_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    ticks = write_log(path)
    data = bytearray(path.read_bytes())
    _, frames = frame_infos(path)
    data[frames[-1].end - 1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert recover_log(path).bytes_dropped == HEADER_SIZE + frames[-1].length
    with LogReader(path) as reader:
        assert list(reader.ticks()) == ticks[:-1]


def test_any_flipped_byte_of_an_earlier_frame_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    write_log(path)
    data = path.read_bytes()
    _, frames = frame_infos(path)
    bad = tmp_path / "bad.tlog"
    for frame in frames[:-1]:
        for pos in range(frame.offset, frame.end):
            damaged = bytearray(data)
            damaged[pos] ^= 0x01 if pos % 2 else 0x80
            bad.write_bytes(bytes(damaged))
            with pytest.raises(LogCorrupt) as info, LogReader(bad) as reader:
                list(reader.ticks())
            assert info.value.offset == frame.offset, (frame, pos)
            assert info.value.tick == frame.tick, (frame, pos)
            assert str(bad) in str(info.value)
            with pytest.raises(LogCorrupt):
                recover_log(bad)
            assert bad.read_bytes() == bytes(damaged)  # recovery never truncates a corrupt log


def test_a_damaged_header_frame_is_corruption_at_offset_zero(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    write_log(path)
    data = path.read_bytes()
    header, _ = frame_infos(path)
    bad = tmp_path / "bad.tlog"
    for pos in range(header.offset, header.end):
        damaged = bytearray(data)
        damaged[pos] ^= 0x04
        bad.write_bytes(bytes(damaged))
        with pytest.raises(LogCorrupt) as info:
            LogReader(bad)
        assert info.value.offset == 0, pos
        assert info.value.tick is None


@pytest.mark.parametrize("content", [b"", b"TL", b"not a log at all, just some text", bytes(100)])
def test_not_a_log_is_corrupt_at_offset_zero(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "a.tlog"
    path.write_bytes(content)
    with pytest.raises(LogCorrupt) as info:
        LogReader(path)
    assert info.value.offset == 0


def test_frame_over_the_size_limit(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    write_log(path)
    header, frames = frame_infos(path)
    biggest = max(frames, key=lambda f: f.length)
    limit = biggest.length - 1
    assert header.length <= limit
    with pytest.raises(LogFrameTooLarge) as info, LogReader(path, max_frame_bytes=limit) as reader:
        list(reader.ticks())
    assert (info.value.offset, info.value.size, info.value.limit) == (
        min(f.offset for f in frames if f.length > limit),
        min(frames, key=lambda f: (f.length <= limit, f.offset)).length,
        limit,
    )
    with pytest.raises(LogFrameTooLarge) as info:
        LogReader(path, max_frame_bytes=header.length - 1)
    assert info.value.offset == 0


def test_unknown_schema_is_incompatible(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    with LogWriter(path, msgspec.structs.replace(HEADER, schema_hash="0123456789abcdef01234567")):
        pass
    with pytest.raises(LogIncompatible) as info:
        LogReader(path)
    message = str(info.value)
    assert "0123456789abcdef01234567" in message
    assert SCHEMA_HASH in message


def test_unknown_format_version_in_the_header_is_incompatible(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    with LogWriter(path, msgspec.structs.replace(HEADER, format_version=FORMAT_VERSION + 1)):
        pass
    with pytest.raises(LogIncompatible) as info:
        LogReader(path)
    assert f"format version {FORMAT_VERSION + 1}" in str(info.value)
    assert f"version {FORMAT_VERSION}" in str(info.value)


def test_a_log_framed_by_a_future_format_version_is_incompatible(tmp_path: Path) -> None:
    """A later writer puts its own version in every frame's magic: that is not corruption."""
    future = FORMAT_VERSION + 1
    path = tmp_path / "a.tlog"
    magic = MAGIC["header"][:3] + bytes([future])
    payload = encode(msgspec.structs.replace(HEADER, format_version=future))
    head = struct.pack("<4sIQ", magic, len(payload), 0)
    path.write_bytes(head + struct.pack("<II", zlib.crc32(head), zlib.crc32(payload)) + payload)
    with pytest.raises(LogIncompatible) as info:
        LogReader(path)
    assert f"format version {future}" in str(info.value)
    assert f"version {FORMAT_VERSION}" in str(info.value)


def test_seek_returns_the_nearest_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    ticks = write_log(path, many_ticks(25), snapshot_every=10)  # snapshots after ticks 9 and 19
    with LogReader(path) as reader:
        for target, snap_tick in [(0, None), (8, None), (9, 9), (15, 9), (19, 19), (24, 19), (100, 19)]:
            snapshot, rest = reader.seek(target)
            assert (snapshot.tick if snapshot else None) == snap_tick, target
            start = 0 if snap_tick is None else snap_tick + 1
            assert list(rest) == ticks[start:], target
            if snapshot is not None:
                assert snapshot == SnapshotRecord(snap_tick, ticks[snap_tick].outputs.digest, b"state")


def test_reader_rejects_a_header_frame_in_the_middle(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    write_log(path)
    with open(path, "ab") as f:
        f.write(pack_frame("header", 0, encode(HEADER)))
        f.write(pack_frame("tick", 99, encode(fixture_ticks()[0])))
    with pytest.raises(LogCorrupt, match="second header"), LogReader(path) as reader:
        list(reader.records())


def test_frame_kind_must_match_its_payload(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    write_log(path)
    t = fixture_ticks()[0]
    with open(path, "ab") as f:
        f.write(pack_frame("snapshot", 5, encode_tick(t.inputs, t.outputs)))
        f.write(pack_frame("tick", 6, encode(t)))
    with pytest.raises(LogCorrupt, match="kind"), LogReader(path) as reader:
        list(reader.records())


def test_fixture_copy_is_readable_from_anywhere(tmp_path: Path) -> None:
    src = Path(__file__).parent / "fixtures" / f"schema-{SCHEMA_HASH}.tlog"
    dst = tmp_path / "copy.tlog"
    shutil.copy(src, dst)
    with LogReader(dst) as reader:
        assert list(reader.ticks()) == fixture_ticks()
