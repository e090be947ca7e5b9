"""Behavioural tests that kill mutants of the log writer (scripts/mutate.sh --area events): new log paths, what a
writer leaves on disk, recovery, and which error names which file."""

from __future__ import annotations

import errno
import os
import struct
import zlib
from pathlib import Path

import pytest
from fixtures.make_fixture import HEADER, fixture_ticks
from log_helpers import header_only, open_fds, write_log

from tickloom.events import (
    LogCorrupt,
    LogError,
    LogExists,
    LogFrameTooLarge,
    LogIncompatible,
    LogReader,
    LogWriter,
    recover_log,
)
from tickloom.events.frames import HEADER_SIZE, pack_frame
from tickloom.events.log import check_new_log_path

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
