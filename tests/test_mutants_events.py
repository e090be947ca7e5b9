"""Behavioural tests that kill the mutants of the events area (scripts/mutate.sh --area events): the log writer and
reader, the frame scan, recovery, the codec and the errors. Each test pins a rule a reader of the log relies on: which
error names which file, byte offset and tick, what a writer leaves on disk, what recovery keeps."""

from __future__ import annotations

import errno
import os
import struct
import zlib
from pathlib import Path

import msgspec
import pytest
from fixtures.make_fixture import HEADER, fixture_ticks

from tickloom.events import (
    LogCorrupt,
    LogError,
    LogExists,
    LogFrameTooLarge,
    LogIncompatible,
    LogReader,
    LogWriter,
    SnapshotRecord,
    TickRecord,
    encode,
    encode_tick,
    recover_log,
)
from tickloom.events.frames import HEADER_SIZE, pack_frame
from tickloom.events.log import check_new_log_path


def write_log(path: Path, ticks: list[TickRecord] | None = None) -> list[TickRecord]:
    ticks = fixture_ticks() if ticks is None else ticks
    with LogWriter(path, HEADER) as writer:
        for record in ticks:
            writer.append_tick(record.inputs, record.outputs)
    return ticks


def header_end(path: Path) -> int:
    with LogReader(path) as reader:
        return reader._first_frame_offset


def header_only(path: Path) -> int:
    """A log of a header frame alone; its size."""
    with LogWriter(path, HEADER):
        pass
    return path.stat().st_size


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


# --- new log paths -----------------------------------------------------------------------------------------------


def test_a_symlink_at_a_new_log_path_is_named_as_one(tmp_path: Path) -> None:
    link = tmp_path / "link.tlog"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(LogExists) as info:
        check_new_log_path(link)
    assert info.value.path == str(link)
    assert str(info.value) == (f"log_path={str(link)!r} is a symlink; tickloom never overwrites a log: choose a new "
                               "path or remove it")
    taken = tmp_path / "taken.tlog"
    taken.write_bytes(b"x")
    with pytest.raises(LogExists) as info:
        check_new_log_path(taken)
    assert info.value.path == str(taken)
    assert str(info.value).startswith(f"log_path={str(taken)!r} already exists;")
    check_new_log_path(tmp_path / "free.tlog")  # a free path passes


def test_the_writer_names_a_symlink_too(tmp_path: Path) -> None:
    link = tmp_path / "link.tlog"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(LogExists) as info:
        LogWriter(link, HEADER)
    assert info.value.path == str(link)
    assert f"log_path={str(link)!r} is a symlink;" in str(info.value)
    assert not (tmp_path / "nowhere").exists()


# --- the writer ----------------------------------------------------------------------------------------------------


def test_short_writes_are_finished_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """os.write may write less than asked: flush writes the rest, in order, and counts every byte once."""
    whole = tmp_path / "whole.tlog"
    ticks = write_log(whole)
    real_write = os.write
    calls: list[int] = []

    def short_write(fd: int, data: bytes | memoryview) -> int:
        calls.append(len(data))
        return real_write(fd, bytes(data)[:7])

    path = tmp_path / "short.tlog"
    monkeypatch.setattr(os, "write", short_write)
    writer = LogWriter(path, HEADER)
    for record in ticks:
        writer.append_tick(record.inputs, record.outputs)
    writer.flush()
    monkeypatch.setattr(os, "write", real_write)
    assert len(calls) > 2
    assert path.read_bytes() == whole.read_bytes()
    assert writer.bytes_written == whole.stat().st_size
    assert writer.pending_bytes == 0
    writer.close()


def test_bytes_written_accumulates_over_flushes(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    ticks = fixture_ticks()
    writer = LogWriter(path, HEADER)
    first = writer.bytes_written
    assert first == path.stat().st_size > 0
    writer.append_tick(ticks[0].inputs, ticks[0].outputs)
    writer.flush()
    writer.append_tick(ticks[1].inputs, ticks[1].outputs)
    writer.sync()
    assert writer.bytes_written == path.stat().st_size > first
    writer.close()


def test_fsync_syncs_the_log_and_refuses_a_closed_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.tlog"
    writer = LogWriter(path, HEADER)
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    writer.fsync()
    assert len(synced) == 1 and os.path.samestat(os.fstat(synced[0]), os.stat(path))
    writer.close()
    with pytest.raises(LogError) as info:
        writer.fsync()
    assert str(info.value) == f"{path}: fsync of a closed log"


def test_abandon_drops_the_buffer_and_closes_the_file(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    before = open_fds()
    writer = LogWriter(path, HEADER)
    size = path.stat().st_size
    t = fixture_ticks()[0]
    writer.append_tick(t.inputs, t.outputs)
    writer.abandon()
    assert open_fds() == before  # the descriptor is closed
    assert path.stat().st_size == size  # what was buffered was never written
    assert writer.pending_bytes == 0
    writer.abandon()  # idempotent
    writer.close()  # and close after it does nothing
    with pytest.raises(LogError, match="closed"):
        writer.flush()
    with LogReader(path) as reader:
        assert list(reader.records()) == []


def test_a_failed_header_write_removes_the_new_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.tlog"
    before = open_fds()

    def full_disk(fd: int, data: bytes | memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError) as info:
        LogWriter(path, HEADER)
    assert info.value.errno == errno.ENOSPC
    assert not os.path.lexists(path)
    assert open_fds() == before


def test_discard_removes_only_the_file_this_writer_created(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    before = open_fds()
    writer = LogWriter(path, HEADER)
    t = fixture_ticks()[0]
    writer.append_tick(t.inputs, t.outputs)
    writer.discard()
    assert not os.path.lexists(path)
    assert open_fds() == before
    assert writer.pending_bytes == 0
    writer.discard()  # idempotent
    writer.close()
    with pytest.raises(LogError, match="closed"):
        writer.flush()

    # The path now names another file: it is left alone.
    writer = LogWriter(path, HEADER)
    os.rename(path, tmp_path / "moved.tlog")
    (tmp_path / "a.tlog").write_bytes(b"someone else's")
    writer.discard()
    assert path.read_bytes() == b"someone else's"
    assert (tmp_path / "moved.tlog").exists()
    assert open_fds() == before

    # The path names nothing any more: nothing to remove, no error.
    other = tmp_path / "b.tlog"
    writer = LogWriter(other, HEADER)
    os.rename(other, tmp_path / "moved-b.tlog")
    writer.discard()
    assert (tmp_path / "moved-b.tlog").exists()
    assert open_fds() == before


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


# --- recovery --------------------------------------------------------------------------------------------------


def test_recovery_of_a_header_only_log(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    size = header_only(path)
    recovery = recover_log(path)
    assert (recovery.frames, recovery.last_tick, recovery.bytes_dropped) == (0, None, 0)
    assert path.stat().st_size == size


def test_recovery_keeps_whole_frames_and_drops_the_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    ticks = write_log(path)
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(pack_frame("tick", len(ticks), b"x" * 40)[:30])
    recovery = recover_log(path)
    assert (recovery.frames, recovery.last_tick, recovery.bytes_dropped) == (len(ticks), ticks[-1].inputs.tick, 30)
    assert path.stat().st_size == size
    assert recover_log(path).bytes_dropped == 0


def test_recovery_applies_the_frame_size_limit(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    write_log(path)
    with pytest.raises(LogFrameTooLarge) as info:
        recover_log(path, max_frame_bytes=HEADER_SIZE)
    assert info.value.offset == 0 and info.value.limit == HEADER_SIZE


# --- errors ----------------------------------------------------------------------------------------------------


def test_error_messages_name_file_offset_and_tick() -> None:
    corrupt = LogCorrupt("a.tlog", 120, 7, "payload CRC mismatch")
    assert (corrupt.path, corrupt.offset, corrupt.tick, corrupt.reason) == ("a.tlog", 120, 7, "payload CRC mismatch")
    assert str(corrupt) == "a.tlog: corrupt frame at byte offset 120 (tick 7): payload CRC mismatch"
    at_header = LogCorrupt("a.tlog", 0, None, "bad")
    assert str(at_header) == "a.tlog: corrupt frame at byte offset 0 (the header): bad"
    assert str(LogCorrupt("a.tlog", 5, 0, "r")) == "a.tlog: corrupt frame at byte offset 5 (tick 0): r"

    large = LogFrameTooLarge("a.tlog", 24, 5000, 4096)
    assert (large.path, large.offset, large.size, large.limit) == ("a.tlog", 24, 5000, 4096)
    assert str(large) == "a.tlog: frame at byte offset 24 declares 5000 bytes, over the limit of 4096 bytes"

    exists = LogExists("a.tlog")
    assert exists.path == "a.tlog"
    assert str(exists) == "log_path='a.tlog' already exists; tickloom never overwrites a log: choose a new path or " \
                          "remove it"
    assert isinstance(exists, FileExistsError) and isinstance(exists, LogError)

    incompatible = LogIncompatible("a.tlog", "schema", "abc", "schemas x")
    assert (incompatible.path, incompatible.offset) == ("a.tlog", 0)
    assert str(incompatible) == ("a.tlog: log schema abc (header frame at byte offset 0) is not readable by this "
                                 "build (it reads schemas x)")


def test_a_raw_frame_header_crc_checks(tmp_path: Path) -> None:
    """pack_frame's header CRC covers magic, length and tick (a reader trusts a length only once it checks)."""
    frame = pack_frame("tick", 9, b"abc")
    magic, length, tick, head_crc, body_crc = struct.unpack_from("<4sIQII", frame)
    assert (length, tick) == (3, 9)
    assert head_crc == zlib.crc32(struct.pack("<4sIQ", magic, length, tick))
    assert body_crc == zlib.crc32(b"abc")


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


# --- reading a file in bounded memory ----------------------------------------------------------------------------


def _file_bytes(tmp_path: Path, data: bytes) -> tuple[int, object]:
    from tickloom.events.frames import FileBytes

    path = tmp_path / "data"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    return fd, FileBytes(fd, len(data))


def test_file_bytes_slices_like_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    from tickloom.events.frames import FileBytes

    monkeypatch.setattr(FileBytes, "WINDOW", 64)
    data = bytes(random.Random(7).randrange(256) for _ in range(1000))
    fd, buf = _file_bytes(tmp_path, data)
    try:
        assert len(buf) == 1000  # type: ignore[arg-type]
        assert bytes(buf[0:4]) == data[0:4]  # type: ignore[index]  # the first read, before any window
        rng = random.Random(11)
        for _ in range(3000):
            start = rng.randrange(-20, 1020)
            stop = start + rng.randrange(-5, 150) if rng.random() < 0.9 else rng.randrange(-20, 1020)
            view = buf[start:stop]  # type: ignore[index]
            assert isinstance(view, memoryview)
            assert bytes(view) == data[start:stop], (start, stop)
        assert bytes(buf[5:5]) == b"" and bytes(buf[900:100]) == b""  # type: ignore[index]
        with pytest.raises(ValueError, match=r"^FileBytes slices are contiguous$"):
            buf[0:10:2]  # type: ignore[index]
    finally:
        os.close(fd)


def test_file_bytes_reads_a_bounded_window(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tickloom.events.frames import FileBytes

    data = bytes(range(256)) * 4096  # 1 MiB
    fd, buf = _file_bytes(tmp_path, data)
    reads: list[tuple[int, int]] = []
    real_pread = os.pread

    def recording(f: int, length: int, offset: int) -> bytes:
        reads.append((length, offset))
        return real_pread(f, length, offset)

    monkeypatch.setattr(os, "pread", recording)
    try:
        assert bytes(buf[900_000:900_010]) == data[900_000:900_010]  # type: ignore[index]
        assert bytes(buf[900_005:900_100]) == data[900_005:900_100]  # type: ignore[index]
        assert reads == [(min(FileBytes.WINDOW, len(data) - 900_000), 900_000)]  # one read, one window
        assert bytes(buf[10:20]) == data[10:20]  # type: ignore[index]
        assert reads[-1] == (FileBytes.WINDOW, 10)
        assert bytes(buf[300_000:300_010]) == data[300_000:300_010]  # type: ignore[index]
        assert reads[-1] == (FileBytes.WINDOW, 300_000)  # a window, however far into the file
    finally:
        os.close(fd)


def test_file_bytes_finishes_short_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytes(range(256)) * 8
    fd, buf = _file_bytes(tmp_path, data)
    real_pread = os.pread
    monkeypatch.setattr(os, "pread", lambda f, length, offset: real_pread(f, min(length, 5), offset))
    try:
        assert bytes(buf[0:2048]) == data  # type: ignore[index]
        assert bytes(buf[100:300]) == data[100:300]  # type: ignore[index]
    finally:
        os.close(fd)
    # a file that shrank under the reader: what is there, no more
    path = tmp_path / "shrinks"
    path.write_bytes(data)
    from tickloom.events.frames import FileBytes

    fd = os.open(path, os.O_RDONLY)
    try:
        buf2 = FileBytes(fd, len(data))
        os.truncate(path, 100)
        assert bytes(buf2[50:500]) == data[50:100]
    finally:
        os.close(fd)


# --- opening a log for reading -------------------------------------------------------------------------------------


def test_known_schema_hashes_are_the_first_word_of_each_line_before_any_comment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tickloom.events import SCHEMA_HASH
    from tickloom.events import log as log_module

    known = log_module.known_schema_hashes()
    assert SCHEMA_HASH in known
    assert all(len(h) == 24 and int(h, 16) >= 0 for h in known), known
    assert len(set(known)) == len(known)

    class Text:
        def __init__(self, text: str) -> None:
            self.text = text

        def joinpath(self, name: str) -> Text:
            assert name == "known_schemas.txt"
            return self

        def read_text(self, encoding: str) -> str:
            return self.text

    text = "# a comment # with two marks\naaa  note # b # c\n\n   \nbbb#ccc\n  ddd eee\n#\n"
    monkeypatch.setattr(log_module.resources, "files", lambda package: Text(text))
    assert log_module.known_schema_hashes() == ("aaa", "bbb", "ddd")


def test_files_that_are_no_readable_log_are_named_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tickloom.events.log import check_log_file

    before = open_fds()
    missing = tmp_path / "missing.tlog"
    for call in (LogReader, check_log_file):
        with pytest.raises(LogError) as info:
            call(missing)
        assert str(info.value) == f"{missing}: no such file (nothing read, at byte offset 0)"
        with pytest.raises(LogError) as info:
            call(tmp_path)
        assert str(info.value) == f"{tmp_path}: is a directory, not a log file (nothing read, at byte offset 0)"
        with pytest.raises(LogError) as info:
            call("/dev/null")
        assert str(info.value) == "/dev/null: is not a regular file (nothing read, at byte offset 0)"
        through = tmp_path / "file"
        through.write_bytes(b"x")
        with pytest.raises(LogError) as info:
            call(through / "log")
        assert str(info.value) == f"{through / 'log'}: cannot read the log (at byte offset 0): Not a directory"
    assert open_fds() == before

    real_open = os.open

    def denied(path: str, flags: int, mode: int = 0o777) -> int:
        if path == str(tmp_path / "secret.tlog"):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(LogError) as info:
        LogReader(tmp_path / "secret.tlog")
    assert str(info.value) == f"{tmp_path / 'secret.tlog'}: permission denied (cannot read the log, at byte offset 0)"
    monkeypatch.setattr(os, "open", real_open)

    ok = tmp_path / "ok.tlog"
    header_only(ok)
    check_log_file(ok)  # a log passes
    real_fstat = os.fstat

    def failing_fstat(fd: int) -> os.stat_result:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fstat", failing_fstat)
    with pytest.raises(LogError) as info:
        check_log_file(ok)
    monkeypatch.setattr(os, "fstat", real_fstat)
    assert str(info.value) == f"{ok}: cannot read the log (at byte offset 0): Input/output error"
    assert open_fds() == before


def test_an_empty_file_or_a_bad_first_frame_is_corrupt_at_the_header(tmp_path: Path) -> None:
    empty = tmp_path / "empty.tlog"
    empty.write_bytes(b"")
    with pytest.raises(LogCorrupt) as info:
        LogReader(empty)
    assert (info.value.path, info.value.offset, info.value.tick, info.value.reason) == (
        str(empty), 0, None, "the file is empty (no header frame)")
    one = tmp_path / "one.tlog"
    one.write_bytes(b"T")
    with pytest.raises(LogCorrupt) as info:
        LogReader(one)
    assert (info.value.path, info.value.offset, info.value.tick, info.value.reason) == (
        str(one), 0, None, "missing or damaged header frame")
    tick_first = tmp_path / "tick.tlog"
    tick_first.write_bytes(pack_frame("tick", 0, b"x"))
    with pytest.raises(LogCorrupt) as info:
        LogReader(tick_first)
    assert (info.value.path, info.value.reason) == (str(tick_first), "missing or damaged header frame")
    t = fixture_ticks()[0]
    not_header = tmp_path / "nothdr.tlog"
    not_header.write_bytes(pack_frame("header", 0, encode(t)))
    with pytest.raises(LogCorrupt) as info:
        LogReader(not_header)
    assert (info.value.path, info.value.offset, info.value.tick, info.value.reason) == (
        str(not_header), 0, None, "first frame is not a header")
    damaged = bytearray(pack_frame("header", 0, encode(HEADER)))
    damaged[2] ^= 0xFF
    bad = tmp_path / "bad.tlog"
    bad.write_bytes(bytes(damaged) + pack_frame("tick", 0, b"x"))
    with pytest.raises(LogCorrupt) as info:
        LogReader(bad)
    assert (info.value.path, info.value.offset, info.value.tick, info.value.reason) == (
        str(bad), 0, None, "bad frame header (magic or header CRC)")


def test_a_future_framing_names_the_file(tmp_path: Path) -> None:
    from tickloom.events import FORMAT_VERSION
    from tickloom.events.frames import MAGIC

    payload = encode(HEADER)
    head = struct.pack("<4sIQ", MAGIC["header"][:3] + bytes([FORMAT_VERSION + 1]), len(payload), 0)
    path = tmp_path / "future.tlog"
    path.write_bytes(head + struct.pack("<II", zlib.crc32(head), zlib.crc32(payload)) + payload)
    with pytest.raises(LogIncompatible) as info:
        LogReader(path)
    assert info.value.path == str(path)
    assert str(info.value) == (f"{path}: log format version {FORMAT_VERSION + 1} (header frame at byte offset 0) is "
                               f"not readable by this build (it reads version {FORMAT_VERSION})")


def test_a_reader_closes_its_file_and_starts_with_an_empty_tail(tmp_path: Path) -> None:
    path = tmp_path / "a.tlog"
    write_log(path)
    before = open_fds()
    reader = LogReader(path)
    assert (reader.tail.end_offset, reader.tail.torn_bytes) == (0, 0)
    reader.close()
    assert open_fds() == before
    with LogReader(path) as reader:
        list(reader.frames())
        assert reader.tail.end_offset == path.stat().st_size
    assert open_fds() == before


def test_framed_format_version_reads_any_version_of_a_checking_header() -> None:
    from tickloom.events import FORMAT_VERSION
    from tickloom.events.frames import framed_format_version

    frame = pack_frame("header", 0, b"")  # exactly one header's bytes
    assert framed_format_version(frame) == FORMAT_VERSION
    assert framed_format_version(b"xx" + frame, 2) == FORMAT_VERSION
    assert framed_format_version(frame[:-1]) is None
    assert framed_format_version(b"x" * 30 + frame, 20) is None  # no header begins at byte 20
    for kind in (b"h", b"t", b"s"):
        head = struct.pack("<4sIQ", b"TL" + kind + b"\x07", 0, 3)
        assert framed_format_version(head + struct.pack("<II", zlib.crc32(head), 0)) == 7, kind
    for magic in (b"TLx\x07", b"XLh\x07", b"TXt\x07"):
        head = struct.pack("<4sIQ", magic, 0, 3)
        assert framed_format_version(head + struct.pack("<II", zlib.crc32(head), 0)) is None, magic
    head = struct.pack("<4sIQ", b"TLh\x07", 0, 3)
    assert framed_format_version(head + struct.pack("<II", zlib.crc32(head) ^ 1, 0)) is None
    assert framed_format_version(b"x" * 40, 30) is None


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    import threading

    from tickloom.events.log import check_log_file

    fifo = tmp_path / "fifo.tlog"
    os.mkfifo(fifo)
    errors: list[BaseException] = []

    def check() -> None:
        try:
            check_log_file(fifo)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=check, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # unblock the open, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("opening a FIFO waited for a writer")
    assert len(errors) == 1 and isinstance(errors[0], LogError)
    assert str(errors[0]) == f"{fifo}: is not a regular file (nothing read, at byte offset 0)"
