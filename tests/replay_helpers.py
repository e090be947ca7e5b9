"""Shared helpers of the replay tests: record the everything-scenario log and rewrite logs to tamper with them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from scenarios import everything_scenario

from tickloom.engine.core.snapshot import CoreSnapshot
from tickloom.events import LogHeader, LogReader, LogWriter, RunStep, SnapshotRecord, TickRecord
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


def step(step_id: int, rows: list[str], tokens: list[int] | None = None) -> RunStep:
    n = len(rows)
    return RunStep(step_id, rows, list(range(n)), [1] * n, tokens if tokens is not None else [7] * n, [-1] * n,
                   list(range(n)), [0] * n, [0] * n, [])


@pytest.fixture(scope="module", name="log")
def everything_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The everything scenario's log, recorded once per module (import it to use it as the ``log`` fixture)."""
    path = tmp_path_factory.mktemp("replay") / "everything.tlog"
    record_everything(path)
    return path


@pytest.fixture(scope="module", name="state")
def state_at_tick_20(log: Path) -> CoreSnapshot:
    """The core after tick 20 of the everything scenario: requests running, preempted and swapped, two steps in
    flight (the ``state`` fixture)."""
    from tickloom.replay import state_at

    snap = state_at(log, 20)
    assert snap.running and snap.preempted and snap.swapping_or_swapped and len(snap.steps) == 2
    return snap


def rid_of(snap: CoreSnapshot, i: int) -> str:
    return snap.seqs[i].request_id


def ticks_of(records: Records) -> list[TickRecord]:
    return [r for r in records if isinstance(r, TickRecord)]
