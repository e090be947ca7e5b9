"""Shared helpers of the replay tests: record the everything-scenario log and rewrite logs to tamper with them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from scenarios import everything_scenario

from tickloom.events import LogHeader, LogReader, LogWriter, SnapshotRecord, TickRecord
from tickloom.replay.record import RecordResult

Records = list[TickRecord | SnapshotRecord]


def record_everything(path: Path, snapshot_every: int = 8) -> RecordResult:
    return everything_scenario().record(path, snapshot_every=snapshot_every)


def read_log(path: Path) -> tuple[LogHeader, Records]:
    with LogReader(path) as reader:
        return reader.header, list(reader.records())


def rewrite(path: Path, out: Path, edit: Callable[[LogHeader, Records], tuple[LogHeader, Records]]) -> Path:
    """Decode every frame of ``path``, apply ``edit``, and write a valid log (right CRCs) to ``out``."""
    header, records = edit(*read_log(path))
    with LogWriter(out, header) as writer:
        for record in records:
            if isinstance(record, TickRecord):
                writer.append_tick(record.inputs, record.outputs)
            else:
                writer.append_snapshot(record)
    assert os.path.getsize(out) > 0
    return out
