"""The router's log: the engine log's file and frame format (``events.log``, ``events.frames``), router records.

A router log is a header frame (an ``events.LogHeader`` whose ``magic`` is ``ROUTER_MAGIC``, whose ``schema_hash``
is the router's and whose ``config_json`` is the ``RouterConfig``), then one tick frame per router tick (a
``RouterTickRecord``) and, every ``snapshot_every`` ticks, a snapshot frame (an ``events.SnapshotRecord`` holding
an encoded ``RouterSnapshot``). So the writer and the reader are the engine's, with the router's payloads: creation
with ``O_EXCL`` and mode 0600, whole-frame flushes, CRCs, torn-tail recovery and corruption offsets all carry over,
and an engine reader opening a router log refuses it cleanly (its schema is not an engine schema).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import cast

import msgspec

from tickloom.events import (
    FORMAT_VERSION,
    LogCorrupt,
    LogError,
    LogHeader,
    LogIncompatible,
    LogReader,
    LogWriter,
    SnapshotRecord,
)
from tickloom.events.frames import DEFAULT_MAX_FRAME_BYTES, FrameInfo, begin_frame, end_frame, read_frame
from tickloom.fleet.router_events import (
    ROUTER_MAGIC,
    ROUTER_SCHEMA_HASH,
    RouterConfig,
    RouterFrame,
    RouterTickRecord,
    known_router_schemas,
)

ROUTER_VERSION = "0.1.0"
_encoder = msgspec.msgpack.Encoder(order="deterministic")
_decoder: msgspec.msgpack.Decoder[RouterFrame] = msgspec.msgpack.Decoder(RouterFrame)


def router_header(config: RouterConfig, snapshot_every: int = 0) -> LogHeader:
    return LogHeader(format_version=FORMAT_VERSION, schema_hash=ROUTER_SCHEMA_HASH, digest_version=1,
                     engine_version=ROUTER_VERSION, config_json=msgspec.json.encode(config).decode(),
                     snapshot_every=snapshot_every, magic=ROUTER_MAGIC)


class RouterLogWriter(LogWriter):
    """``events.LogWriter`` for a router log: a new file (never overwritten), router tick frames."""

    def __init__(self, path: str | os.PathLike[str], config: RouterConfig, snapshot_every: int = 0) -> None:
        super().__init__(path, router_header(config, snapshot_every))

    def append_router_tick(self, record: RouterTickRecord) -> int:
        """Buffer one tick frame; returns its size. ``flush`` hands it to the OS."""
        buf = self._buffer
        start = begin_frame(buf)
        try:
            buf += _encoder.encode(record)
        except BaseException:
            del buf[start:]
            raise
        return end_frame(buf, start, "tick", record.inputs.tick)


class RouterLogReader(LogReader):
    """``events.LogReader`` for a router log: ``records()`` (and ``raw_frames()``, with each record's frame) yield
    ``RouterTickRecord`` and ``SnapshotRecord``."""

    def _check_compatible(self, header: LogHeader) -> None:
        if header.magic != ROUTER_MAGIC:
            raise LogIncompatible(self.path, "kind", header.magic, f"a router log ({ROUTER_MAGIC})")
        if header.format_version != FORMAT_VERSION:
            raise LogIncompatible(self.path, "format version", str(header.format_version), f"version {FORMAT_VERSION}")
        known = known_router_schemas()
        if header.schema_hash not in known:
            raise LogIncompatible(self.path, "router schema", header.schema_hash,
                                  f"schemas {', '.join(known)} (this build: {ROUTER_SCHEMA_HASH})")

    def _decode(self, info: FrameInfo) -> RouterFrame:  # type: ignore[override]
        view = self._buf[info.payload_offset : info.end]
        try:
            return _decoder.decode(view)
        except (msgspec.MsgspecError, RecursionError) as exc:
            raise LogCorrupt(self.path, info.offset, info.tick, f"payload does not decode: {exc}") from exc
        finally:
            view.release()

    def _decode_raw(self, info: FrameInfo) -> RouterFrame:  # type: ignore[override]
        return self._decode(info)  # nothing is left encoded: ``raw_frames`` yields (frame, record) pairs

    @property
    def config(self) -> RouterConfig:
        """The header's router configuration (``LogCorrupt`` if it is not one)."""
        try:
            return RouterConfig.checked(self.header.config_json)
        except ValueError as exc:
            raise LogCorrupt(self.path, 0, None, f"the header's configuration: {exc}") from None

    def __enter__(self) -> RouterLogReader:
        return self

    def router_frames(self) -> Iterator[tuple[FrameInfo, RouterTickRecord | SnapshotRecord]]:
        """``raw_frames``, typed for a router log."""
        for info, record in self.raw_frames():
            yield info, cast(RouterTickRecord | SnapshotRecord, record)

    def router_records(self, start_offset: int | None = None) -> Iterator[RouterTickRecord | SnapshotRecord]:
        """``records``, typed for a router log."""
        for record in self.records(start_offset):
            yield cast(RouterTickRecord | SnapshotRecord, record)

    def router_ticks(self) -> Iterator[RouterTickRecord]:
        for record in self.router_records():
            if isinstance(record, RouterTickRecord):
                yield record


def is_router_log(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` starts with a whole header frame that names a router log (False for anything else)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    try:
        info = read_frame(head, 0, path=os.fspath(path), expected_tick=None, max_frame_bytes=DEFAULT_MAX_FRAME_BYTES)
    except LogError:  # damaged: not recognisably a router log; the engine's reader reports the damage
        return False
    if info is None or info.kind != "header":
        return False
    try:
        header = msgspec.msgpack.decode(head[info.payload_offset : info.end], type=LogHeader)
    except msgspec.MsgspecError:
        return False
    return header.magic == ROUTER_MAGIC
