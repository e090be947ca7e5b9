"""Behavioural tests that kill mutants of the log reader (scripts/mutate.sh --area events): every error names the file,
the frame's byte offset and its tick, and the frame scan tells a torn tail from corruption."""

from __future__ import annotations

import errno
import os
import struct
import zlib
from pathlib import Path

import msgspec
import pytest
from fixtures.make_fixture import HEADER, fixture_ticks
from log_helpers import header_only, write_log

from tickloom.events import (
    LogCorrupt,
    LogExists,
    LogFrameTooLarge,
    LogIncompatible,
    LogReader,
    LogWriter,
    SnapshotRecord,
    encode,
    encode_tick,
    recover_log,
)
from tickloom.events.frames import HEADER_SIZE, pack_frame

# --- the reader: every error names the file, the frame's byte offset and its tick ----------------------------------


def test_a_tick_payload_that_does_not_decode_raw_is_corrupt_at_its_frame(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    header_only(path)
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(pack_frame("tick", 0, b"\xc1not msgpack"))
        f.write(pack_frame("tick", 1, b"\xc1not msgpack"))
    for read in (lambda r: list(r.raw_records()), lambda r: list(r.records())):
        with pytest.raises(LogCorrupt) as info, LogReader(path) as reader:
            read(reader)
        assert (info.value.path, info.value.offset, info.value.tick) == (str(path), offset, 0)
        assert info.value.reason.startswith("payload does not decode: ")
        assert str(info.value).startswith(f"{path}: corrupt frame at byte offset {offset} (tick 0): payload does not "
                                          "decode: ")


def test_a_second_header_is_named_with_its_frame(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    write_log(path)
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(pack_frame("header", 3, encode(HEADER)))
    with pytest.raises(LogCorrupt) as info, LogReader(path) as reader:
        list(reader.records())
    assert (info.value.path, info.value.offset, info.value.tick, info.value.reason) == (
        str(path), offset, 3, "a second header frame")


def test_a_frame_kind_unlike_its_payload_is_named_with_its_frame(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    header_only(path)
    offset = path.stat().st_size
    t = fixture_ticks()[0]
    with open(path, "ab") as f:
        f.write(pack_frame("snapshot", 0, encode_tick(t.inputs, t.outputs)))
    for read in (lambda r: list(r.records()), lambda r: list(r.raw_records())):
        with pytest.raises(LogCorrupt) as info, LogReader(path) as reader:
            read(reader)
        assert (info.value.path, info.value.offset, info.value.tick, info.value.reason) == (
            str(path), offset, 0, "frame kind does not match its payload")


def test_a_payload_naming_another_tick_is_named(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    header_only(path)
    offset = path.stat().st_size
    t = fixture_ticks()[0]
    wrong = msgspec.structs.replace(t, outputs=msgspec.structs.replace(t.outputs, tick=t.outputs.tick + 5))
    with open(path, "ab") as f:
        f.write(pack_frame("tick", t.inputs.tick, encode(wrong)))
    with pytest.raises(LogCorrupt) as info, LogReader(path) as reader:
        list(reader.records())
    assert (info.value.path, info.value.offset, info.value.tick) == (str(path), offset, t.inputs.tick)
    assert info.value.reason == (f"the payload names tick {t.inputs.tick}, the frame header tick {t.inputs.tick}")


def test_snapshot_record_refuses_a_frame_that_is_no_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    write_log(path)
    with LogReader(path) as reader:
        info = next(iter(reader.frames()))
        with pytest.raises(LogCorrupt) as error:
            reader.snapshot_record(info)
    assert (error.value.path, error.value.offset, error.value.tick, error.value.reason) == (
        str(path), info.offset, info.tick, "frame kind does not match its payload")


def test_snapshot_record_checks_the_snapshot_tick(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    header_only(path)
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(pack_frame("snapshot", 0, encode(SnapshotRecord(4, bytes(16), b"state"))))
    with LogReader(path) as reader:
        info = next(iter(reader.frames()))
        with pytest.raises(LogCorrupt) as error:
            reader.snapshot_record(info)
    assert (error.value.offset, error.value.tick) == (offset, 0)
    assert error.value.reason == "the payload names tick 4, the frame header tick 0"



# --- the frame scan: torn versus corrupt ------------------------------------------------------------------------


def test_append_returns_the_frame_size(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    t = fixture_ticks()[0]
    with LogWriter(path, HEADER) as writer:
        before = writer.bytes_written + writer.pending_bytes
        size = writer.append_tick(t.inputs, t.outputs)
        assert size == writer.bytes_written + writer.pending_bytes - before == HEADER_SIZE + len(
            encode_tick(t.inputs, t.outputs))
        before += size
        snap = writer.append_snapshot(SnapshotRecord(t.inputs.tick, t.outputs.digest, b"state"))
        assert snap == writer.bytes_written + writer.pending_bytes - before == HEADER_SIZE + len(
            encode(SnapshotRecord(t.inputs.tick, t.outputs.digest, b"state")))


def test_an_empty_payload_frame_at_the_very_end_is_whole(tmp_path: Path) -> None:
    """A frame of a header alone (no payload) ending the file exactly is a whole frame, not a torn tail."""
    path = tmp_path / "a.tlog"
    header_only(path)
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(pack_frame("tick", 0, b""))
    with LogReader(path) as reader:
        infos = list(reader.frames())
        assert [(i.kind, i.tick, i.offset, i.length) for i in infos] == [("tick", 0, offset, 0)]
        assert reader.tail.torn_bytes == 0


def _damaged_then(tmp_path: Path, after: bytes) -> Path:
    """A header-only log, then a tick frame whose header is damaged, then ``after``."""
    path = tmp_path / "a.tlog"
    header_only(path)
    frame = bytearray(pack_frame("tick", 0, b"payload"))
    frame[8] ^= 0xFF  # a byte of the tick: the header CRC no longer checks
    with open(path, "ab") as f:
        f.write(bytes(frame) + after)
    return path


def _classify(path: Path) -> str:
    try:
        with LogReader(path) as reader:
            list(reader.frames())
            return "torn" if reader.tail.torn_bytes else "whole"
    except LogCorrupt:
        return "corrupt"


@pytest.mark.parametrize("chunk", [64, 97])
def test_a_valid_header_anywhere_after_the_damage_is_found_across_scan_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """The scan reads in chunks that overlap by a header less one byte: a header straddling any boundary is seen,
    whatever else (a false "TL") comes before it."""
    from tickloom.events import frames

    monkeypatch.setattr(frames, "_SCAN_CHUNK", chunk)
    valid = pack_frame("tick", 5, b"data")
    for gap in range(0, 3 * chunk):
        noise = (b"TLx" + bytes(range(1, 200)))[: gap] if gap % 2 else bytes(gap)
        path = _damaged_then(tmp_path, noise + valid)
        assert _classify(path) == "corrupt", gap
        os.unlink(path)
    for gap in (0, chunk - 3, chunk, 2 * chunk + 5):
        path = _damaged_then(tmp_path, (b"TL" * 40 + b"garbage")[:gap] + valid[: HEADER_SIZE - 1])
        assert _classify(path) == "torn", gap  # a partial header, and "TL"s that are no header: torn
        os.unlink(path)


def test_a_header_found_late_in_a_chunk_full_of_false_starts(tmp_path: Path) -> None:
    """Several "TL"s that are no header, then a header: the scan looks at each in turn, from the first."""
    valid = pack_frame("tick", 5, b"data")
    path = _damaged_then(tmp_path, b"TLTL..TLxxTL" + valid + b"TLzz")
    assert _classify(path) == "corrupt"
    os.unlink(path)
    path = _damaged_then(tmp_path, valid + b"..TL....TL")
    assert _classify(path) == "corrupt"  # a header first, then false starts: still corrupt


def test_a_header_straddling_the_damaged_frame_start_is_not_data_after_it(tmp_path: Path) -> None:
    """Only headers beginning after the damaged frame's first byte count: one that would begin a byte before (in
    the last frame before it) is not data after the damage."""
    path = tmp_path / "a.tlog"
    header_only(path)
    valid = pack_frame("tick", 0, b"")  # 24 bytes, starting with b"T"
    with open(path, "ab") as f:
        f.write(pack_frame("tick", 0, b"whole payload " + valid[:1]))  # a whole frame ending in "T"
        f.write(valid[1:])  # 23 bytes: an incomplete, damaged frame at the end
    with LogReader(path) as reader:
        assert len(list(reader.frames())) == 1
        assert reader.tail.torn_bytes == HEADER_SIZE - 1


def test_read_frame_scans_plain_bytes_too() -> None:
    from tickloom.events.frames import read_frame

    good = pack_frame("tick", 1, b"abc")
    damaged = bytearray(pack_frame("tick", 0, b"xyz"))
    damaged[0] ^= 0xFF
    buf = bytes(damaged) + good
    with pytest.raises(LogCorrupt) as info:
        read_frame(buf, 0, path="mem", expected_tick=0, max_frame_bytes=1000)
    assert (info.value.offset, info.value.tick) == (0, 0)
    assert read_frame(bytes(damaged), 0, path="mem", expected_tick=0, max_frame_bytes=1000) is None
    info2 = read_frame(buf, len(damaged), path="mem", expected_tick=1, max_frame_bytes=1000)
    assert info2 is not None and (info2.kind, info2.tick, info2.offset, info2.length) == ("tick", 1, len(damaged), 3)


def _bad_body_then(tmp_path: Path, tail: bytes, hole: int = 0) -> Path:
    """A log whose last frame's payload is damaged, followed by ``tail`` and then a hole of ``hole`` bytes."""
    path = tmp_path / "a.tlog"
    header_only(path)
    frame = bytearray(pack_frame("tick", 0, b"payload bytes"))
    frame[-1] ^= 0xFF
    with open(path, "ab") as f:
        f.write(bytes(frame) + tail)
    if hole:
        os.truncate(path, path.stat().st_size + hole)
    return path


@pytest.mark.parametrize("chunk", [None, 16])
def test_a_damaged_last_frame_then_only_zeros_is_torn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int | None
) -> None:
    from tickloom.events import frames

    if chunk is not None:
        monkeypatch.setattr(frames, "_SCAN_CHUNK", chunk)
    for tail, hole in [(bytes(50), 0), (b"", 3 << 20), (bytes(40), 1 << 20), (bytes(5), 0)]:
        path = _bad_body_then(tmp_path, tail, hole)
        assert _classify(path) == "torn", (len(tail), hole)
        recovery = recover_log(path)
        assert recovery.frames == 0 and recovery.bytes_dropped > 0
        os.unlink(path)
    for tail in (bytes(40) + b"\x01", b"\x01" + bytes(40), bytes(20) + b"\x07" + bytes(20)):
        path = _bad_body_then(tmp_path, tail)
        assert _classify(path) == "corrupt", tail
        os.unlink(path)
    path = _bad_body_then(tmp_path, bytes(10) + b"\x01", hole=1 << 20)  # data, then a hole
    assert _classify(path) == "corrupt"


def test_when_the_file_system_cannot_tell_holes_the_scan_reads_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lseek(SEEK_DATA) failing for any reason but "no data after this" means: read on, never skip."""
    valid = pack_frame("tick", 5, b"data")
    path = _damaged_then(tmp_path, bytes(100) + valid)
    real_lseek = os.lseek

    def no_seek_data(fd: int, pos: int, how: int) -> int:
        if how == os.SEEK_DATA:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_lseek(fd, pos, how)

    monkeypatch.setattr(os, "lseek", no_seek_data)
    assert _classify(path) == "corrupt"


def test_a_hole_to_the_end_of_the_file_skips_the_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With holes known (SEEK_DATA), a hole to the end is never read: it holds no frame."""
    from tickloom.events.frames import FileBytes

    path = tmp_path / "sparse"
    path.write_bytes(b"abc")
    os.truncate(path, 1 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = FileBytes(fd, 1 << 20)
        assert buf.next_data(0) == 0
        assert buf.next_data(1 << 20) == 1 << 20
        assert buf.next_data((1 << 20) + 5) == 1 << 20
        assert buf.next_data(500 << 10) == 1 << 20  # inside the hole that runs to the end
    finally:
        os.close(fd)


def test_a_stray_byte_before_a_whole_frame_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    header_only(path)
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x00" + pack_frame("tick", 0, b"abc"))
    with pytest.raises(LogCorrupt) as info, LogReader(path) as reader:
        list(reader.frames())
    assert (info.value.path, info.value.offset, info.value.tick, info.value.reason) == (
        str(path), offset, 0, "bad frame header (magic or header CRC)")


def test_a_zero_tail_must_be_zeros_only(tmp_path: Path) -> None:
    for tail in (b"XX" + bytes(30), bytes(30) + b"X", b"\n" + bytes(20)):
        path = _bad_body_then(tmp_path, tail)
        assert _classify(path) == "corrupt", tail
        os.unlink(path)


def test_the_frame_size_limit_is_inclusive(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    header_only(path)
    with open(path, "ab") as f:
        f.write(pack_frame("tick", 0, b"x" * 300))
    with LogReader(path, max_frame_bytes=300) as reader:
        assert [i.length for i in reader.frames()] == [300]
    with pytest.raises(LogFrameTooLarge) as info, LogReader(path, max_frame_bytes=299) as reader:
        list(reader.frames())
    assert (info.value.path, info.value.size, info.value.limit) == (str(path), 300, 299)


def _frame_with_length(kind: str, tick: int, length: int, payload: bytes) -> bytes:
    """A frame whose header checks but declares ``length`` payload bytes (``payload`` is what follows)."""
    from tickloom.events.frames import MAGIC

    head = struct.pack("<4sIQ", MAGIC[kind], length, tick)  # type: ignore[index]
    return head + struct.pack("<II", zlib.crc32(head), zlib.crc32(payload)) + payload


def test_a_length_past_the_end_with_frames_after_is_corruption_naming_the_frame(tmp_path: Path) -> None:
    whole = pack_frame("tick", 1, b"abc")
    path = tmp_path / "a.tlog"
    header_only(path)
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(_frame_with_length("tick", 7, 5000, b"") + whole)
    size = path.stat().st_size
    with pytest.raises(LogCorrupt) as info, LogReader(path) as reader:
        list(reader.frames())
    assert (info.value.path, info.value.offset, info.value.tick, info.value.reason) == (
        str(path), offset, 7, f"frame declares 5000 payload bytes, past the end of the file at {size}")

    # the same at the header frame: named as the header (no tick)
    path = tmp_path / "b.tlog"
    path.write_bytes(_frame_with_length("header", 0, 5000, b"") + whole)
    with pytest.raises(LogCorrupt) as info:
        LogReader(path)
    assert (info.value.offset, info.value.tick) == (0, None)
    assert info.value.reason == f"frame declares 5000 payload bytes, past the end of the file at {len(whole) + 24}"


def test_a_damaged_payload_before_more_data_names_its_frame(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    header_only(path)
    offset = path.stat().st_size
    bad = bytearray(pack_frame("tick", 3, b"payload"))
    bad[-1] ^= 0xFF
    with open(path, "ab") as f:
        f.write(bytes(bad) + pack_frame("tick", 4, b"x"))
    with pytest.raises(LogCorrupt) as info, LogReader(path) as reader:
        list(reader.frames())
    assert (info.value.path, info.value.offset, info.value.tick, info.value.reason) == (
        str(path), offset, 3, "payload CRC mismatch")

    # a damaged header frame's payload: named as the header
    header = bytearray(pack_frame("header", 0, encode(HEADER)))
    header[-1] ^= 0xFF
    path = tmp_path / "b.tlog"
    path.write_bytes(bytes(header) + pack_frame("tick", 0, b"x"))
    with pytest.raises(LogCorrupt) as info:
        LogReader(path)
    assert (info.value.offset, info.value.tick, info.value.reason) == (0, None, "payload CRC mismatch")


def test_the_log_is_created_private_not_only_made_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The file is created with mode 0600 (no moment with wider permissions), fchmod only restores bits a umask took."""
    monkeypatch.setattr(os, "fchmod", lambda fd, mode: None)
    old = os.umask(0)
    try:
        LogWriter(tmp_path / "a.tlog", HEADER).close()
    finally:
        os.umask(old)
    assert (tmp_path / "a.tlog").stat().st_mode & 0o777 == 0o600


def test_open_errors_of_a_new_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.tlog"
    writer = LogWriter(path, HEADER)
    assert writer.header is HEADER and writer.path == str(path)
    writer.close()
    real_open = os.open

    def failing(error: int) -> object:
        def fake(p: str, flags: int, mode: int = 0o777) -> int:
            if p == str(tmp_path / "b.tlog"):
                raise OSError(error, os.strerror(error))
            return real_open(p, flags, mode)
        return fake

    monkeypatch.setattr(os, "open", failing(errno.ELOOP))
    with pytest.raises(LogExists) as info:
        LogWriter(tmp_path / "b.tlog", HEADER)
    assert info.value.path == str(tmp_path / "b.tlog")
    assert str(info.value) == (f"log_path={str(tmp_path / 'b.tlog')!r} is a symlink; tickloom never overwrites a "
                               "log: choose a new path or remove it")
    monkeypatch.setattr(os, "open", failing(errno.EACCES))
    with pytest.raises(OSError) as error:
        LogWriter(tmp_path / "b.tlog", HEADER)
    assert error.value.errno == errno.EACCES and not isinstance(error.value, LogExists)


def test_incompatible_logs_name_the_file_and_what_this_build_reads(tmp_path: Path) -> None:
    from tickloom.events import FORMAT_VERSION, SCHEMA_HASH
    from tickloom.events.log import known_schema_hashes

    path = tmp_path / "a.tlog"
    with LogWriter(path, msgspec.structs.replace(HEADER, schema_hash="0123456789abcdef01234567")):
        pass
    with pytest.raises(LogIncompatible) as info:
        LogReader(path)
    assert info.value.path == str(path)
    assert str(info.value) == (
        f"{path}: log schema 0123456789abcdef01234567 (header frame at byte offset 0) is not readable by this build "
        f"(it reads schemas {', '.join(known_schema_hashes())} (this build: {SCHEMA_HASH}))")
    path = tmp_path / "b.tlog"
    with LogWriter(path, msgspec.structs.replace(HEADER, format_version=FORMAT_VERSION + 3)):
        pass
    with pytest.raises(LogIncompatible) as info:
        LogReader(path)
    assert info.value.path == str(path)
    assert str(info.value) == (f"{path}: log format version {FORMAT_VERSION + 3} (header frame at byte offset 0) is "
                               f"not readable by this build (it reads version {FORMAT_VERSION})")


def test_encode_tick_embeds_the_given_encoded_commands() -> None:
    from tickloom.events import encode_commands
    from tickloom.events.codec import decode_frame_raw

    t = next(r for r in fixture_ticks() if r.outputs.commands)
    other = encode_commands([])
    assert other != encode_commands(t.outputs.commands)
    raw = decode_frame_raw(encode_tick(t.inputs, t.outputs, other))
    assert bytes(raw.outputs.commands) == other
    assert encode_tick(t.inputs, t.outputs, encode_commands(t.outputs.commands)) == encode(t)
