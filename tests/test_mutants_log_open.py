"""Behavioural tests that kill mutants of the log reader (scripts/mutate.sh --area events): reading a file in bounded
memory, and opening a log for reading."""

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
    LogIncompatible,
    LogReader,
    encode,
)
from tickloom.events.frames import pack_frame

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
