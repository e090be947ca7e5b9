"""One log is one file: a header frame, then one frame per tick and a snapshot frame every N ticks.

``LogWriter`` only encodes and writes; *when* to flush and fsync (never, every tick, every N ms) is the log
actor's policy, in ``actors/``. ``LogReader`` verifies frames lazily as it iterates, and can seek to a tick by
walking frame headers to the nearest snapshot. ``recover_log`` truncates a torn tail. See ``events.frames`` for
the byte layout and the torn-versus-corrupt rule.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
from collections.abc import Iterator
from importlib import resources
from types import TracebackType
from typing import TypeVar

import msgspec

from tickloom.events.codec import (
    FORMAT_VERSION,
    SCHEMA_HASH,
    RawTickRecord,
    decode_frame,
    decode_frame_raw,
    encode_into,
    encode_tick_into,
)
from tickloom.events.errors import LogCorrupt, LogError, LogExists, LogIncompatible
from tickloom.events.frames import (
    DEFAULT_MAX_FRAME_BYTES,
    FileBytes,
    FrameInfo,
    begin_frame,
    end_frame,
    framed_format_version,
    read_frame,
)
from tickloom.events.records import Frame, LogHeader, SnapshotRecord, TickInputs, TickOutputs, TickRecord

_Tick = TypeVar("_Tick", TickRecord, RawTickRecord)


def known_schema_hashes() -> tuple[str, ...]:
    """Schema hashes this build reads, from the checked-in, append-only ``known_schemas.txt``."""
    text = resources.files(__package__).joinpath("known_schemas.txt").read_text(encoding="utf-8")
    lines = (line.split("#", 1)[0].split() for line in text.splitlines())
    return tuple(parts[0] for parts in lines if parts)


_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
"""A log is always a new file: ``O_EXCL`` refuses any existing path (a symlink too, even a dangling one, so a
planted link can never redirect the writes) and ``O_NOFOLLOW`` says so twice."""


def check_new_log_path(path: str | os.PathLike[str]) -> None:
    """Raise ``LogExists`` if ``path`` is taken. Only an early, friendly check (say, before loading a model):
    ``LogWriter`` itself refuses atomically."""
    spath = os.fspath(path)
    if os.path.islink(spath):
        raise LogExists(spath, "is a symlink")
    if os.path.lexists(spath):
        raise LogExists(spath)


class LogWriter:
    """Appends frames to a new log file (mode 0600). Not thread-safe; one writer per file.

    The file must not exist: an existing path (file, directory or symlink) raises ``LogExists`` and is left
    untouched. tickloom never overwrites a log.
    """

    def __init__(self, path: str | os.PathLike[str], header: LogHeader) -> None:
        self.path = os.fspath(path)
        self._buffer = bytearray()
        self.bytes_written = 0
        self.header = header
        start = begin_frame(self._buffer)
        encode_into(self._buffer, header)
        end_frame(self._buffer, start, "header", 0)
        try:
            fd = os.open(self.path, _CREATE_FLAGS, 0o600)
        except FileExistsError as exc:
            what = "is a symlink" if os.path.islink(self.path) else "already exists"
            raise LogExists(self.path, what) from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW's answer where O_EXCL did not speak first
                raise LogExists(self.path, "is a symlink") from exc
            raise
        self._fd: int | None = fd
        self._identity: tuple[int, int] | None = None
        try:
            self._identity = _identity(os.fstat(fd))
            # Safe: this fd is a file we just created (O_EXCL). The umask can only have removed bits from 0600;
            # put the owner's read and write back so the log stays readable and appendable.
            os.fchmod(fd, 0o600)
            self.flush()  # a log always starts with a readable header, even if nothing else is ever written
        except BaseException:
            # A file without its header (a full disk, say) is no log, and it would block the path (O_EXCL): remove
            # it, the one this writer created, and let the error through.
            self.discard()
            raise

    # Frames are encoded straight into the write buffer behind a reserved header (no payload copies); if encoding
    # raises, the partial frame is cut off again so the buffer only ever holds whole frames.
    def append_tick(self, inputs: TickInputs, outputs: TickOutputs, encoded_commands: bytes | None = None) -> int:
        """Buffer one tick frame; returns its size. Pass the core's encoded commands to skip re-encoding."""
        buf = self._buffer
        start = begin_frame(buf)
        try:
            encode_tick_into(buf, inputs, outputs, encoded_commands)
        except BaseException:
            del buf[start:]
            raise
        return end_frame(buf, start, "tick", inputs.tick)

    def append_snapshot(self, snapshot: SnapshotRecord) -> int:
        """Buffer one snapshot frame; returns its size."""
        buf = self._buffer
        start = begin_frame(buf)
        try:
            encode_into(buf, snapshot)
        except BaseException:
            del buf[start:]
            raise
        return end_frame(buf, start, "snapshot", snapshot.tick)

    def flush(self) -> None:
        """Hand buffered frames to the OS (no fsync). Frames are written whole, in order."""
        if self._fd is None:
            raise LogError(f"{self.path}: write to a closed log")
        buf = self._buffer
        if not buf:
            return
        written = os.write(self._fd, buf)
        if written < len(buf):  # a short write (rare on a regular file): finish it
            with memoryview(buf) as view:
                while written < len(view):
                    written += os.write(self._fd, view[written:])
        self.bytes_written += written
        buf.clear()

    def sync(self) -> None:
        """Flush, then fsync: everything appended so far survives a crash of the machine."""
        self.flush()
        self.fsync()

    def fsync(self) -> None:
        """fsync what has been flushed. Touches no buffer, so it may run on another thread during appends."""
        if self._fd is None:
            raise LogError(f"{self.path}: fsync of a closed log")
        os.fsync(self._fd)

    @property
    def pending_bytes(self) -> int:
        """Bytes appended but not yet flushed."""
        return len(self._buffer)

    def close(self) -> None:
        """Flush and close. Idempotent."""
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            os.close(self._fd)
            self._fd = None

    def abandon(self) -> None:
        """Close without writing what is buffered: after a write error the file ends at its last whole frame."""
        self._buffer.clear()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        """Close without writing what is buffered, and remove the file: for a log whose engine never started.
        Only the file this writer created is removed: if the path now names another file, it is left alone."""
        fd = self._fd
        self._buffer = bytearray()  # not clear(): a failed write's traceback may still hold a view of it
        if fd is None:
            return
        try:
            try:
                same = self._identity is not None and _identity(os.lstat(self.path)) == self._identity
            except OSError:
                same = False
            if same:
                os.unlink(self.path)
        finally:
            self._fd = None
            os.close(fd)

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


@dataclasses.dataclass(slots=True)
class TailInfo:
    """What the last completed scan found at the end of the file."""

    end_offset: int = 0
    torn_bytes: int = 0


def open_log_file(path: str) -> int:
    """Open a log for reading; its descriptor. Anything that is not a readable regular file raises ``LogError``
    with one line naming the problem: no such file, a directory, no permission, not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO there never hangs us
    except FileNotFoundError:
        raise LogError(f"{path}: no such file (nothing read, at byte offset 0)") from None
    except PermissionError:
        raise LogError(f"{path}: permission denied (cannot read the log, at byte offset 0)") from None
    except OSError as exc:  # a path through a file (ENOTDIR), a loop of links, ...
        raise LogError(f"{path}: cannot read the log (at byte offset 0): {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise LogError(f"{path}: cannot read the log (at byte offset 0): {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "is a directory, not a log file" if stat.S_ISDIR(mode) else "is not a regular file"
        raise LogError(f"{path}: {what} (nothing read, at byte offset 0)")
    return fd


def check_log_file(path: str | os.PathLike[str]) -> None:
    """Raise ``LogError`` (one line naming the problem) unless ``path`` is a regular file this process can open for
    reading: the check a command makes before it decides what kind of log it was given. What is in the file is
    the reader's to judge."""
    os.close(open_log_file(os.fspath(path)))


class LogReader:
    """Reads and verifies a log. Frames are checked (CRCs, size limit) as they are iterated."""

    def __init__(self, path: str | os.PathLike[str], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.path = os.fspath(path)
        self.max_frame_bytes = max_frame_bytes
        self._fd: int | None = open_log_file(self.path)
        try:
            size = os.fstat(self._fd).st_size
            if size == 0:
                raise LogCorrupt(self.path, 0, None, "the file is empty (no header frame)")
            # Read with pread, a window at a time: memory stays bounded however large the file (a zero tail of any
            # size included), where an mmap would take the whole file's size in address space.
            self._buf = FileBytes(self._fd, size)
            self.tail = TailInfo()
            self.header: LogHeader = self._read_header()
        except BaseException:
            self.close()
            raise

    def _read_header(self) -> LogHeader:
        version = framed_format_version(self._buf, 0)
        if version is not None and version != FORMAT_VERSION:
            raise LogIncompatible(self.path, "format version", str(version), f"version {FORMAT_VERSION}")
        first = read_frame(self._buf, 0, path=self.path, expected_tick=None, max_frame_bytes=self.max_frame_bytes)
        if first is None or first.kind != "header":
            raise LogCorrupt(self.path, 0, None, "missing or damaged header frame")
        header = self._decode(first)
        if not isinstance(header, LogHeader):
            raise LogCorrupt(self.path, 0, None, "first frame is not a header")
        self._check_compatible(header)
        self._first_frame_offset = first.end
        return header

    def _check_compatible(self, header: LogHeader) -> None:
        if header.format_version != FORMAT_VERSION:
            raise LogIncompatible(self.path, "format version", str(header.format_version), f"version {FORMAT_VERSION}")
        known = known_schema_hashes()
        if header.schema_hash not in known:
            raise LogIncompatible(
                self.path, "schema", header.schema_hash, f"schemas {', '.join(known)} (this build: {SCHEMA_HASH})"
            )

    def _decode(self, info: FrameInfo) -> Frame:
        # The slice is released explicitly, so that no view of the read window outlives the decode.
        view = self._buf[info.payload_offset : info.end]
        try:
            return decode_frame(view)
        except (msgspec.MsgspecError, RecursionError) as exc:  # msgspec: RecursionError on deep nesting
            raise LogCorrupt(self.path, info.offset, info.tick, f"payload does not decode: {exc}") from exc
        finally:
            view.release()

    def _decode_raw(self, info: FrameInfo) -> LogHeader | RawTickRecord | SnapshotRecord:
        try:
            return decode_frame_raw(bytes(self._buf[info.payload_offset : info.end]))
        except (msgspec.MsgspecError, RecursionError) as exc:  # msgspec: RecursionError on deep nesting
            raise LogCorrupt(self.path, info.offset, info.tick, f"payload does not decode: {exc}") from exc

    def frames(self, start_offset: int | None = None) -> Iterator[FrameInfo]:
        """Verified frames after the header, lazily. Stops at a torn tail (see ``tail``); raises on corruption."""
        offset = self._first_frame_offset if start_offset is None else start_offset
        expected: int | None = 0
        while offset < len(self._buf):
            info = read_frame(
                self._buf, offset, path=self.path, expected_tick=expected, max_frame_bytes=self.max_frame_bytes
            )
            if info is None:
                break
            yield info
            expected = info.tick + 1
            offset = info.end
        self.tail = TailInfo(end_offset=offset, torn_bytes=len(self._buf) - offset)

    def records(self, start_offset: int | None = None) -> Iterator[TickRecord | SnapshotRecord]:
        """Decoded tick and snapshot records, in file order."""
        for info in self.frames(start_offset):
            yield self._check_kind(info, self._decode(info))

    def raw_records(self) -> Iterator[RawTickRecord | SnapshotRecord]:
        """``records``, with each tick's commands left encoded: about half the decoding, for exact replay."""
        for _, record in self.raw_frames():
            yield record

    def raw_frames(self) -> Iterator[tuple[FrameInfo, RawTickRecord | SnapshotRecord]]:
        """``raw_records`` with each record's frame, so that a caller can name the byte offset of bad data."""
        for info in self.frames():
            yield info, self._check_kind(info, self._decode_raw(info))

    def _check_kind(self, info: FrameInfo, record: LogHeader | _Tick | SnapshotRecord) -> _Tick | SnapshotRecord:
        if isinstance(record, LogHeader):
            raise LogCorrupt(self.path, info.offset, info.tick, "a second header frame")
        ticks: tuple[int, ...]
        if isinstance(record, SnapshotRecord):
            kind, ticks = "snapshot", (record.tick,)
        else:
            kind, ticks = "tick", (record.inputs.tick, record.outputs.tick)
        if info.kind != kind:
            raise LogCorrupt(self.path, info.offset, info.tick, "frame kind does not match its payload")
        if any(t != info.tick for t in ticks):
            raise LogCorrupt(self.path, info.offset, info.tick, f"the payload names tick {ticks[0]}, the frame "
                             f"header tick {info.tick}")
        return record

    def ticks(self) -> Iterator[TickRecord]:
        """Tick records only, in order."""
        for record in self.records():
            if isinstance(record, TickRecord):
                yield record

    def seek(self, tick: int) -> tuple[SnapshotRecord | None, Iterator[TickRecord]]:
        """The newest snapshot taken at or before ``tick`` (None if none) and the tick records after it.

        Walks frame headers only; payloads are decoded from the snapshot on.
        """
        best = self.nearest_snapshot(tick)
        if best is None:
            return None, self.ticks()
        return self.snapshot_record(best), (r for r in self.records(best.end) if isinstance(r, TickRecord))

    def nearest_snapshot(self, tick: int) -> FrameInfo | None:
        """The frame of the newest snapshot taken at or before ``tick``, by walking frame headers only."""
        best: FrameInfo | None = None
        for info in self.frames():
            if info.tick > tick:
                break
            if info.kind == "snapshot":
                best = info
        return best

    def snapshot_record(self, info: FrameInfo) -> SnapshotRecord:
        """Decode the snapshot frame ``info`` (from ``nearest_snapshot`` or ``frames``)."""
        snapshot = self._decode(info)
        if not isinstance(snapshot, SnapshotRecord):
            raise LogCorrupt(self.path, info.offset, info.tick, "frame kind does not match its payload")
        self._check_kind(info, snapshot)
        return snapshot

    def close(self) -> None:
        """Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> LogReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Recovery:
    """What ``recover_log`` found: whole frames kept, the last whole tick, and the torn bytes it dropped."""

    frames: int
    last_tick: int | None
    bytes_dropped: int


def recover_log(path: str | os.PathLike[str], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Recovery:
    """Truncate a torn tail so the log ends at its last whole frame. Corruption raises ``LogCorrupt``."""
    frames = 0
    last_tick: int | None = None
    with LogReader(path, max_frame_bytes=max_frame_bytes) as reader:
        for info in reader.frames():
            frames += 1
            last_tick = info.tick
        tail = reader.tail
    if tail.torn_bytes:
        os.truncate(path, tail.end_offset)
    return Recovery(frames, last_tick, tail.torn_bytes)
