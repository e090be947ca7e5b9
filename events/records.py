"""What a log holds: the header, one record per tick, and periodic core snapshots."""

from __future__ import annotations

from tickloom.events.commands import Command
from tickloom.events.inputs import Input
from tickloom.events.types import CoreGauges, Record


class TickInputs(Record, frozen=True):
    """Everything the core sees in one tick, in the order it applies it."""

    tick: int
    now_ns: int
    inputs: list[Input]


class TickOutputs(Record, frozen=True):
    """Everything one tick decided. ``needs_tick``: tick again even with no new input."""

    tick: int
    commands: list[Command]
    needs_tick: bool
    gauges: CoreGauges
    digest: bytes


class TickRecord(Record, frozen=True, tag="tick"):
    """The payload of one tick frame: the tick's inputs and outputs together."""

    inputs: TickInputs
    outputs: TickOutputs


class SnapshotRecord(Record, frozen=True, tag="snapshot"):
    """The core's whole state after ``tick``, encoded by the core (``state``), with the digest at that point."""

    tick: int
    digest: bytes
    state: bytes


class LogHeader(Record, frozen=True, tag="header"):
    """The first frame of every log: what wrote it and with which configuration."""

    format_version: int
    schema_hash: str
    digest_version: int
    engine_version: str
    config_json: str
    """Canonical JSON of the engine configuration, including the core's."""
    model_fingerprint: str = ""
    tokenizer_fingerprint: str = ""
    torch_version: str = ""
    device: str = ""
    dtype: str = ""
    threads: int = 0
    snapshot_every: int = 0
    magic: str = "tickloom-log"


Frame = LogHeader | TickRecord | SnapshotRecord
"""Any frame payload."""
