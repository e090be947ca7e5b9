"""Shared helpers of the log tests: write the fixture's ticks to a log, and where its frames start."""

from __future__ import annotations

import os
from pathlib import Path

from fixtures.make_fixture import HEADER, fixture_ticks

from tickloom.events import LogReader, LogWriter, TickRecord


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
