"""The one msgpack encoding of the vocabulary, and the schema hash that names it.

One ``Encoder`` and one ``Decoder`` per process, reused (msgspec's advice for speed). Encoding uses
``order="deterministic"``, so equal values give equal bytes in every process whatever ``PYTHONHASHSEED`` is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from tickloom.events.commands import Command
from tickloom.events.records import Frame, LogHeader, SnapshotRecord, TickInputs, TickOutputs, TickRecord
from tickloom.events.types import CoreGauges, Record

FORMAT_VERSION = 1
"""Version of the frame layout (see ``events.log``); the payload schema is versioned by ``SCHEMA_HASH``."""

_encoder = msgspec.msgpack.Encoder(order="deterministic")
_frame_decoder = msgspec.msgpack.Decoder(Frame)
_commands_decoder = msgspec.msgpack.Decoder(list[Command])


def encode(value: object) -> bytes:
    """Encode any vocabulary value (or list of them) to msgpack."""
    return _encoder.encode(value)


def decode_frame(payload: bytes | memoryview) -> Frame:
    """Decode one frame payload; raises ``msgspec.ValidationError`` or ``msgspec.DecodeError`` on bad data."""
    return _frame_decoder.decode(payload)


def decode_commands(payload: bytes) -> list[Command]:
    """Decode a list of commands encoded with :func:`encode_commands`."""
    return _commands_decoder.decode(payload)


def encode_commands(commands: Sequence[Command]) -> bytes:
    """Encode a tick's commands once: the digest hashes these bytes and the frame embeds them unchanged."""
    return _encoder.encode(commands)


# Why these two mirror types: the digest is computed over the encoded commands, and the tick frame holds the
# same commands again. Encoding them twice would double the hot path's encode cost, so the frame is encoded
# through a Struct with the same field order whose ``commands`` is the already-encoded ``msgspec.Raw``. The
# bytes are identical to encoding ``TickRecord`` directly (a test checks it), so readers never know. Replay
# decodes through them too: it compares digests, and needs the logged commands only when a tick diverges.
class RawTickOutputs(Record, frozen=True):
    """``TickOutputs`` with the commands left encoded."""

    tick: int
    commands: msgspec.Raw
    needs_tick: bool
    gauges: CoreGauges
    digest: bytes


class RawTickRecord(Record, frozen=True, tag="tick"):
    """``TickRecord`` with the commands left encoded (``decode_commands`` reads them)."""

    inputs: TickInputs
    outputs: RawTickOutputs


_raw_frame_decoder: msgspec.msgpack.Decoder[LogHeader | RawTickRecord | SnapshotRecord] = msgspec.msgpack.Decoder(
    LogHeader | RawTickRecord | SnapshotRecord
)


def decode_frame_raw(payload: bytes) -> LogHeader | RawTickRecord | SnapshotRecord:
    """``decode_frame``, leaving a tick's commands encoded. ``payload`` must be ``bytes``: the raw commands
    are a view of it, and a view of a log's mmap would keep the file from closing."""
    return _raw_frame_decoder.decode(payload)


def _tick_wire(inputs: TickInputs, outputs: TickOutputs, encoded_commands: bytes | None) -> RawTickRecord:
    raw = msgspec.Raw(encoded_commands if encoded_commands is not None else encode_commands(outputs.commands))
    wire = RawTickOutputs(outputs.tick, raw, outputs.needs_tick, outputs.gauges, outputs.digest)
    return RawTickRecord(inputs, wire)


def encode_tick(inputs: TickInputs, outputs: TickOutputs, encoded_commands: bytes | None = None) -> bytes:
    """Encode a tick frame payload, reusing ``encoded_commands`` (from :func:`encode_commands`) if given."""
    return _encoder.encode(_tick_wire(inputs, outputs, encoded_commands))


def encode_tick_into(
    buf: bytearray, inputs: TickInputs, outputs: TickOutputs, encoded_commands: bytes | None = None
) -> None:
    """Append the bytes of :func:`encode_tick` to ``buf`` (no intermediate copy)."""
    if encoded_commands is None:
        _encoder.encode_into(TickRecord(inputs, outputs), buf, -1)
    else:
        _encoder.encode_into(_tick_wire(inputs, outputs, encoded_commands), buf, -1)


def encode_into(buf: bytearray, value: object) -> None:
    """Append the bytes of :func:`encode` to ``buf``."""
    _encoder.encode_into(value, buf, -1)


def _wire_only(node: object) -> object:
    """Drop docs from a JSON schema: only what reaches the bytes may change the hash."""
    if isinstance(node, dict):
        return {k: _wire_only(v) for k, v in node.items() if k not in ("title", "description")}
    if isinstance(node, list):
        return [_wire_only(v) for v in node]
    return node


def schema_hash(types: list[object]) -> str:
    """Hash of the wire schema of ``types``: field order, types, defaults and tags (not docs). The engine log's
    hash is this over its frames; the router log's, over its own."""
    _, components = msgspec.json.schema_components(types)
    canonical = msgspec.json.encode(_wire_only(components), order="deterministic")
    return hashlib.blake2b(canonical, digest_size=12).hexdigest()


def compute_schema_hash() -> str:
    """Hash of the wire schema of every frame type of the engine log."""
    return schema_hash([Frame])


SCHEMA_HASH = compute_schema_hash()
"""The schema hash of this build; must appear in ``known_schemas.txt`` (a test checks it)."""
