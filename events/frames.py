"""The frame layout of a log file, and the scan that tells a torn tail from corruption.

A log is a sequence of frames. Each frame is a 24-byte header followed by a msgpack payload::

    magic      4 bytes   b"TL" + kind (b"h" header, b"t" tick, b"s" snapshot) + format version byte
    length     u32 LE    payload bytes
    tick       u64 LE    the tick the frame belongs to (0 for the header)
    head_crc   u32 LE    zlib.crc32 of magic + length + tick
    body_crc   u32 LE    zlib.crc32 of the payload

Why the tick sits in the header: seek and bisect walk frame headers to the nearest snapshot without decoding a
single payload. Why a CRC over the header fields: a damaged length must never send the reader to a wrong
offset, so the length is trusted only once its own CRC checks.

Recovery follows RocksDB's "tolerate a corrupted tail" mode: only a bad *final* frame is a torn write (a crash
mid-append) and is dropped; a bad frame followed by any valid frame header is corruption and is reported with
its byte offset, never skipped.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import struct
import zlib
from collections.abc import Iterator
from typing import Literal

from tickloom.events.codec import FORMAT_VERSION
from tickloom.events.errors import LogCorrupt, LogFrameTooLarge

FrameKind = Literal["header", "tick", "snapshot"]

HEADER = struct.Struct("<4sIQII")
HEADER_SIZE = HEADER.size
_HEAD_FIELDS = struct.Struct("<4sIQ")
_VERSION_BYTE = bytes([FORMAT_VERSION])
MAGIC: dict[FrameKind, bytes] = {
    "header": b"TLh" + _VERSION_BYTE,
    "tick": b"TLt" + _VERSION_BYTE,
    "snapshot": b"TLs" + _VERSION_BYTE,
}
_KIND_OF_MAGIC: dict[bytes, FrameKind] = {v: k for k, v in MAGIC.items()}

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024


def pack_frame(kind: FrameKind, tick: int, payload: bytes) -> bytes:
    """One whole frame: header then payload."""
    magic = MAGIC[kind]
    length = len(payload)
    head_crc = zlib.crc32(_HEAD_FIELDS.pack(magic, length, tick))
    return HEADER.pack(magic, length, tick, head_crc, zlib.crc32(payload)) + payload


_BLANK_HEADER = bytes(HEADER_SIZE)


def begin_frame(buf: bytearray) -> int:
    """Reserve a frame header at the end of ``buf``; returns the frame's start. Append the payload, then call
    :func:`end_frame`. Together they build the same bytes as ``pack_frame`` without copying the payload."""
    start = len(buf)
    buf += _BLANK_HEADER
    return start


def end_frame(buf: bytearray, start: int, kind: FrameKind, tick: int) -> int:
    """Fill in the header of the frame begun at ``start``, whose payload is the rest of ``buf``; returns the
    frame's size."""
    magic = MAGIC[kind]
    length = len(buf) - start - HEADER_SIZE
    head_crc = zlib.crc32(_HEAD_FIELDS.pack(magic, length, tick))
    with memoryview(buf) as view:
        body_crc = zlib.crc32(view[start + HEADER_SIZE :])
    HEADER.pack_into(buf, start, magic, length, tick, head_crc, body_crc)
    return HEADER_SIZE + length


@dataclasses.dataclass(frozen=True, slots=True)
class FrameInfo:
    """Where one verified frame lies in the file."""

    kind: FrameKind
    tick: int
    offset: int
    length: int

    @property
    def payload_offset(self) -> int:
        return self.offset + HEADER_SIZE

    @property
    def end(self) -> int:
        return self.offset + HEADER_SIZE + self.length


class FileBytes:
    """A log file read as bytes, in bounded memory: ``len`` is its size when opened, and a slice is a read-only
    ``memoryview`` read with ``pread`` (never an mmap, so neither the address space nor the resident memory grows
    with the file). One window of the file is kept: the frame just verified is decoded from the same read.

    Does not own ``fd``."""

    WINDOW = 256 * 1024

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self._size = size
        self._start = 0
        self._window = memoryview(b"")

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: slice) -> memoryview:
        start, stop, step = index.indices(self._size)
        if step != 1:
            raise ValueError("FileBytes slices are contiguous")
        if stop <= start:
            return memoryview(b"")
        ours = start - self._start
        if ours >= 0 and stop - self._start <= len(self._window):
            return self._window[ours : stop - self._start]
        want = min(self._size, start + max(stop - start, self.WINDOW)) - start
        self._window = memoryview(self._pread(start, want))
        self._start = start
        return self._window[: stop - start]

    def _pread(self, offset: int, length: int) -> bytes:
        data = os.pread(self._fd, length, offset)
        if len(data) == length or not data:
            return data
        parts = [data]  # a short read: finish it, or stop where the file now ends (it shrank under us)
        got = len(data)
        while got < length:
            more = os.pread(self._fd, length - got, offset + got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    def next_data(self, offset: int) -> int:
        """The first offset at or after ``offset`` that is not in a hole of a sparse file (holes read as zeros, so
        no frame begins in one); ``len(self)`` if only a hole is left. ``offset`` itself where the file system
        cannot tell."""
        if offset >= self._size:
            return self._size
        try:
            return min(os.lseek(self._fd, offset, os.SEEK_DATA), self._size)
        except OSError as exc:
            return self._size if exc.errno == errno.ENXIO else offset


Source = bytes | memoryview | FileBytes
"""What the frame scan reads: a whole file in memory, or ``FileBytes``."""


def _next_data(buf: Source, offset: int) -> int:
    return buf.next_data(offset) if isinstance(buf, FileBytes) else offset


def _parse_header(buf: Source, offset: int) -> tuple[FrameKind, int, int, int] | None:
    """(kind, length, tick, body_crc) if the frame header at ``offset`` is whole and checks, else None."""
    if len(buf) - offset < HEADER_SIZE:
        return None
    magic, length, tick, head_crc, body_crc = HEADER.unpack(buf[offset : offset + HEADER_SIZE])
    kind = _KIND_OF_MAGIC.get(bytes(magic))
    if kind is None or zlib.crc32(_HEAD_FIELDS.pack(magic, length, tick)) != head_crc:
        return None
    return kind, length, tick, body_crc


def framed_format_version(buf: Source, offset: int = 0) -> int | None:
    """The format version byte of a whole, CRC-checking frame header at ``offset`` of *any* format version, or
    None. Lets a reader tell a log from a later format (incompatible) from a damaged one (corrupt)."""
    if len(buf) - offset < HEADER_SIZE:
        return None
    magic, length, tick, head_crc, _ = HEADER.unpack(buf[offset : offset + HEADER_SIZE])
    magic = bytes(magic)
    if magic[:2] != b"TL" or magic[2:3] not in (b"h", b"t", b"s"):
        return None
    if zlib.crc32(_HEAD_FIELDS.pack(magic, length, tick)) != head_crc:
        return None
    return magic[3]


_SCAN_CHUNK = 1 << 20


def _data_chunks(buf: Source, start: int, overlap: int = 0) -> Iterator[bytes]:
    """The bytes from ``start`` to the end, ``_SCAN_CHUNK`` at a time (each with ``overlap`` bytes of the next),
    skipping the holes of a sparse file: a zero tail of any size costs nothing, and nothing is held but a chunk."""
    size = len(buf)
    chunk_start = start
    while chunk_start < size:
        # Anything that began before a hole was seen by the chunk before it (the overlap reads the hole's zeros).
        chunk_start = _next_data(buf, chunk_start)
        if chunk_start >= size:
            return
        yield bytes(buf[chunk_start : min(size, chunk_start + _SCAN_CHUNK + overlap)])
        chunk_start += _SCAN_CHUNK


def _valid_header_after(buf: Source, start: int) -> bool:
    """Whether any checking frame header begins at or after ``start`` (the corruption-versus-torn test).

    Scans in chunks, so a damaged frame early in a large log never copies the rest of the file."""
    # Each chunk overlaps the next by a header's length less one, so no header straddles unseen.
    for data in _data_chunks(buf, start, HEADER_SIZE - 1):
        pos = data.find(b"TL")
        while pos != -1 and pos < _SCAN_CHUNK:
            if _parse_header(data, pos) is not None:
                return True
            pos = data.find(b"TL", pos + 1)
    return False


def _only_zeros_after(buf: Source, start: int) -> bool:
    """Whether every byte from ``start`` to the end is zero: space the file holds but nothing was written to (a
    preallocated or zero-filled tail after a crash)."""
    return not any(data.strip(b"\0") for data in _data_chunks(buf, start))


def read_frame(
    buf: Source, offset: int, *, path: str, expected_tick: int | None, max_frame_bytes: int
) -> FrameInfo | None:
    """Verify the frame at ``offset``. Returns it, or None if the rest of the file is a torn tail.

    Raises ``LogCorrupt`` if the frame is bad and valid data follows it, and ``LogFrameTooLarge`` if it declares
    a payload over ``max_frame_bytes``. ``expected_tick`` (None for the header) names the frame in errors when its
    own header cannot be trusted.
    """
    size = len(buf)
    parsed = _parse_header(buf, offset)
    if parsed is None:
        if size - offset >= HEADER_SIZE and _valid_header_after(buf, offset + 1):
            raise LogCorrupt(path, offset, expected_tick, "bad frame header (magic or header CRC)")
        return None
    kind, length, tick, body_crc = parsed
    if length > max_frame_bytes:
        raise LogFrameTooLarge(path, offset, length, max_frame_bytes)
    end = offset + HEADER_SIZE + length
    if end > size:
        # An incomplete frame is a torn tail only if it is the last one: a length that runs past the end of the
        # file while whole frames follow is damage, never a reason to drop (or let recovery truncate) them.
        if _valid_header_after(buf, offset + HEADER_SIZE):
            raise LogCorrupt(path, offset, None if kind == "header" else tick,
                             f"frame declares {length} payload bytes, past the end of the file at {size}")
        return None
    if zlib.crc32(buf[offset + HEADER_SIZE : end]) != body_crc:
        if end == size or _only_zeros_after(buf, end):  # the last frame written, torn; then nothing, or zeros
            return None
        raise LogCorrupt(path, offset, None if kind == "header" else tick, "payload CRC mismatch")
    return FrameInfo(kind, tick, offset, length)
