"""Exact replay: feed every logged ``TickInputs`` to the real core and check each ``TickOutputs`` against the log.

Digests are compared first (one bytes comparison per tick); commands, gauges and state are diffed only at the
first tick whose digest differs. Snapshot frames are checked too: the replayed core's encoded state must equal the
logged one byte for byte.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import msgspec

from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.engine.core.snapshot import CoreSnapshot, decode_snapshot, encode_snapshot
from tickloom.events import (
    Command,
    LogCorrupt,
    LogError,
    LogHeader,
    LogReader,
    RunStep,
    SnapshotRecord,
    TickRecord,
    decode_commands,
)
from tickloom.events.codec import RawTickRecord
from tickloom.events.frames import FrameInfo
from tickloom.replay.diff import diff_commands, diff_gauges, diff_state, summarise_inputs
from tickloom.replay.header import ReplayConfigError, core_config_from_header, digest_problem

Status = Literal["identical", "divergent", "unreadable", "violation", "clean"]

EXIT_CODES: dict[str, int] = {"identical": 0, "clean": 0, "divergent": 1, "violation": 1, "unreadable": 2}
"""Exit status of ``tickloom replay`` per report status."""


@dataclasses.dataclass(slots=True)
class ReplayReport:
    """What a replay found. ``status`` "identical"/"clean" (exit 0), "divergent"/"violation" (1), "unreadable" (2)."""

    status: Status
    path: str
    ticks: int = 0
    """Ticks replayed (checked identical before the first divergence)."""
    rows: int = 0
    """``RunStep`` rows replayed."""
    seconds: float = 0.0
    torn_bytes: int = 0
    """Bytes of a torn final frame that replay stopped before."""
    snapshots_checked: int = 0
    first_divergent_tick: int | None = None
    error: str | None = None
    """Why the log is unreadable, or what the core raised while replaying, or the invariant violated."""
    inputs: list[str] = dataclasses.field(default_factory=list)
    """The divergent tick's inputs, summarised."""
    command_diff: list[str] = dataclasses.field(default_factory=list)
    gauges_diff: list[str] = dataclasses.field(default_factory=list)
    needs_tick_diff: str | None = None
    state_diff: list[str] = dataclasses.field(default_factory=list)
    state_tick: int | None = None
    """The tick the state diff compares at (a logged snapshot at or after the divergence)."""
    engine_version: str = ""
    schema_hash: str = ""
    format_version: int = 0
    digest_version: int = 0
    byte_offset: int | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    @property
    def ticks_per_s(self) -> float:
        return self.ticks / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["ticks_per_s"] = self.ticks_per_s
        return out

    def format_text(self) -> str:
        return format_report(self)


def open_log(path: str | os.PathLike[str]) -> LogReader:
    """Open a log for reading (the header is read and checked at once)."""
    return LogReader(path)


def mark_unreadable(report: ReplayReport, exc: BaseException) -> ReplayReport:
    """Set ``report`` to ``unreadable`` with ``exc``'s message and, when it has one, its byte offset."""
    report.status = "unreadable"
    report.error = str(exc)
    report.byte_offset = getattr(exc, "offset", None)
    return report


def _bad_header(report: ReplayReport, problem: str) -> ReplayReport:
    report.status = "unreadable"
    report.error = f"{report.path}: the header (frame at byte offset 0): {problem}"
    report.byte_offset = 0
    return report


def _with_header(report: ReplayReport, header: LogHeader) -> None:
    report.engine_version = header.engine_version
    report.schema_hash = header.schema_hash
    report.format_version = header.format_version
    report.digest_version = header.digest_version


def verify(path: str | os.PathLike[str], *, check_snapshots: bool = True) -> ReplayReport:
    """Replay the log at ``path`` on a fresh core and compare every tick; see ``ReplayReport``."""
    report = ReplayReport("identical", os.fspath(path))
    start = time.perf_counter()
    try:
        with LogReader(path) as reader:
            _with_header(report, reader.header)
            problem = digest_problem(reader.header)
            if problem is not None:
                return _bad_header(report, problem)
            try:
                core = SchedulerCore(core_config_from_header(reader.header))
            except ReplayConfigError as exc:
                return _bad_header(report, f"the configuration is not a valid core config: {exc}")
            _replay(reader, core, report, check_snapshots)
            if report.status == "identical":
                report.torn_bytes = reader.tail.torn_bytes
    except LogError as exc:
        return mark_unreadable(report, exc)
    finally:
        report.seconds = time.perf_counter() - start
    return report


def _replay(reader: LogReader, core: SchedulerCore, report: ReplayReport, check_snapshots: bool) -> None:
    frames = reader.raw_frames()
    records = (record for _, record in frames)
    rows = 0
    ticks = 0
    expected_tick = 0
    tick_fn = core.tick
    for info, record in frames:
        if type(record) is RawTickRecord:
            inputs = record.inputs
            logged = record.outputs
            if inputs.tick != expected_tick or logged.tick != inputs.tick:
                report.error = (
                    f"the log holds tick {inputs.tick} (outputs of tick {logged.tick}) where tick {expected_tick} "
                    "was expected"
                )
                _diverged(report, expected_tick, record, None, core, records)
                break
            try:
                out = tick_fn(inputs)
            except Exception as exc:
                report.error = f"the core raised at tick {inputs.tick}: {type(exc).__name__}: {exc}"
                _diverged(report, inputs.tick, record, None, core, records)
                break
            if out.digest != logged.digest or out.needs_tick != logged.needs_tick:
                report.command_diff = diff_commands(_logged_commands(reader, info, logged.commands), out.commands)
                report.gauges_diff = diff_gauges(logged.gauges, out.gauges)
                if out.needs_tick != logged.needs_tick:
                    report.needs_tick_diff = f"needs_tick: expected {logged.needs_tick}, got {out.needs_tick}"
                _diverged(report, inputs.tick, record, out, core, records)
                break
            # The digest covers the commands and gauges the core produced; the log's own copies must be those.
            if memoryview(logged.commands) != core.last_encoded_commands or logged.gauges != out.gauges:
                raise LogCorrupt(reader.path, info.offset, info.tick,
                                 "the logged commands or gauges do not match the logged digest")
            for command in out.commands:
                if type(command) is RunStep:
                    rows += len(command.request_ids)
            ticks += 1
            expected_tick += 1
        elif isinstance(record, SnapshotRecord):
            if record.tick != core.state.tick:  # a snapshot follows the tick frame it was taken after
                raise LogCorrupt(reader.path, info.offset, info.tick,
                                 f"a snapshot of tick {record.tick} where the log is at tick {core.state.tick}")
            if not check_snapshots:
                continue
            actual = encode_snapshot(core.snapshot())
            report.snapshots_checked += 1
            if record.digest != core.state.digest or actual != record.state:
                logged_state = _logged_snapshot(reader, info, record)
                report.first_divergent_tick = record.tick
                report.status = "divergent"
                report.error = f"the replayed core state after tick {record.tick} differs from the logged snapshot"
                report.state_tick = record.tick
                report.state_diff = diff_state(logged_state, decode_snapshot(actual))
                break
    report.ticks = ticks
    report.rows = rows


def _logged_commands(reader: LogReader, info: FrameInfo, raw: msgspec.Raw) -> list[Command]:
    try:
        return decode_commands(bytes(raw))
    except (msgspec.MsgspecError, RecursionError) as exc:  # msgspec: RecursionError on deep nesting
        raise LogCorrupt(reader.path, info.offset, info.tick, f"the logged commands do not decode: {exc}") from exc


def _logged_snapshot(reader: LogReader, info: FrameInfo, record: SnapshotRecord) -> CoreSnapshot:
    try:
        snapshot = decode_snapshot(record.state)
    except (msgspec.MsgspecError, RecursionError) as exc:  # msgspec: RecursionError on deep nesting
        raise LogCorrupt(reader.path, info.offset, info.tick, f"the snapshot state does not decode: {exc}") from exc
    n = len(snapshot.seqs)
    queues = (snapshot.waiting, snapshot.running, snapshot.preempted, snapshot.swapping_or_swapped)
    if not 0 <= snapshot.live <= n or any(not 0 <= i < n for queue in queues for i in queue):
        raise LogCorrupt(reader.path, info.offset, info.tick, "the snapshot state names sequences it does not hold")
    return snapshot


def _diverged(
    report: ReplayReport,
    tick: int,
    record: RawTickRecord,
    out: object,
    core: SchedulerCore,
    records: Iterator[RawTickRecord | SnapshotRecord],
) -> None:
    """Fill in the divergence and, where a logged snapshot lies at or after it, the state difference there."""
    report.status = "divergent"
    report.first_divergent_tick = tick
    report.inputs = summarise_inputs(record.inputs.inputs)
    if out is None:
        return
    # Keep feeding the logged inputs to the diverged core up to the next logged snapshot, then diff the states.
    running = tick
    try:
        for later in records:
            if isinstance(later, SnapshotRecord):
                if later.tick == core.state.tick:
                    report.state_tick = later.tick
                    report.state_diff = diff_state(decode_snapshot(later.state), core.snapshot())
                    return
                continue
            if later.inputs.tick - tick > 1024:
                return
            running = later.inputs.tick
            core.tick(later.inputs)
    except Exception as exc:
        # The tick that raised, as logged: a core that raises may have advanced its own tick already, or not.
        report.state_diff = [f"(no state diff: the diverged core raised at tick {running}: {exc})"]


def core_at(path: str | os.PathLike[str], tick: int) -> SchedulerCore:
    """The core as it was after ``tick``: restored from the nearest snapshot at or before it, then replayed.

    Frames before the snapshot are walked by header only. Raises ``LogError`` if the log cannot be read (a snapshot
    that does not decode or restore is ``LogCorrupt``), ``ReplayConfigError`` if its header's configuration is not
    a sane core configuration, and ``ValueError`` if it ends before ``tick``.
    """
    with LogReader(path) as reader:
        config = core_config_from_header(reader.header)
        info = reader.nearest_snapshot(tick)
        if info is not None:
            core = _restore(reader, info, config)
            rest: Iterator[TickRecord] = (r for r in reader.records(info.end) if isinstance(r, TickRecord))
        else:
            core = SchedulerCore(config)
            rest = reader.ticks()
        if core.state.tick >= tick:
            return core
        for record in rest:
            core.tick(record.inputs)
            if record.inputs.tick >= tick:
                return core
    raise ValueError(f"{os.fspath(path)}: the log ends at tick {core.state.tick}, before tick {tick}")


def _restore(reader: LogReader, info: FrameInfo, config: CoreConfig) -> SchedulerCore:
    """The core restored from the snapshot frame ``info``, whose configuration must be the header's."""
    record = reader.snapshot_record(info)
    snapshot = _logged_snapshot(reader, info, record)
    if snapshot.config != config:
        raise LogCorrupt(reader.path, info.offset, info.tick, "the snapshot's configuration is not the header's")
    if snapshot.tick != record.tick:
        raise LogCorrupt(reader.path, info.offset, info.tick, f"the snapshot state is of tick {snapshot.tick}")
    try:
        return SchedulerCore.from_snapshot(snapshot)
    except Exception as exc:  # untrusted data: any failure to rebuild the state is damage at this frame
        raise LogCorrupt(reader.path, info.offset, info.tick,
                         f"the snapshot does not restore: {type(exc).__name__}: {exc}") from exc


def state_at(path: str | os.PathLike[str], tick: int) -> CoreSnapshot:
    """The core's whole state after ``tick`` (see ``core_at``)."""
    return core_at(path, tick).snapshot()


def bisect(
    path: str | os.PathLike[str], check: Callable[[SchedulerCore], None] | None = None
) -> ReplayReport:
    """Replay every tick and run ``check`` (default ``check_invariants``) after each; report the first failure.

    Status "clean" if none fails, "violation" naming the tick and the violation otherwise.
    """
    report = ReplayReport("clean", os.fspath(path))
    checker = check or SchedulerCore.check_invariants
    start = time.perf_counter()
    try:
        with LogReader(path) as reader:
            _with_header(report, reader.header)
            core = SchedulerCore(core_config_from_header(reader.header))
            for record in reader.ticks():
                try:
                    out = core.tick(record.inputs)
                    checker(core)
                except Exception as exc:
                    report.status = "violation"
                    report.first_divergent_tick = record.inputs.tick
                    report.error = f"{type(exc).__name__}: {exc}"
                    report.inputs = summarise_inputs(record.inputs.inputs)
                    break
                report.ticks += 1
                report.rows += sum(len(c.request_ids) for c in out.commands if isinstance(c, RunStep))
            report.torn_bytes = reader.tail.torn_bytes
    except LogError as exc:
        return mark_unreadable(report, exc)
    except ReplayConfigError as exc:
        _bad_header(report, f"the configuration is not a valid core config: {exc}")
    finally:
        report.seconds = time.perf_counter() - start
    return report


def format_report(report: ReplayReport) -> str:
    """The human form of a report."""
    if report.status == "identical":
        line = f"identical: {report.ticks} ticks, {report.rows} rows, {report.ticks_per_s:.0f} ticks/s"
        if report.torn_bytes:
            line += f" (torn tail: {report.torn_bytes} bytes after the last whole frame were dropped)"
        return line
    if report.status == "clean":
        return f"clean: no invariant violated in {report.ticks} ticks ({report.rows} rows)"
    if report.status == "unreadable":
        return f"unreadable: {report.error}"
    written = (
        f"  log written by engine {report.engine_version!r}, schema {report.schema_hash}, "
        f"format {report.format_version}, digest v{report.digest_version}"
    )
    if report.status == "violation":
        lines = [f"violation at tick {report.first_divergent_tick}: {report.error}", written, "  inputs:"]
        lines += [f"    {line}" for line in report.inputs] or ["    (none)"]
        return "\n".join(lines)
    lines = [f"divergent: first divergent tick {report.first_divergent_tick} (after {report.ticks} identical ticks)"]
    if report.error:
        lines.append(f"  {report.error}")
    lines.append(written)
    lines.append("  inputs of that tick:")
    lines += [f"    {line}" for line in report.inputs] or ["    (none)"]
    if report.command_diff:
        lines.append("  commands (expected = logged, got = replayed):")
        lines += [f"    {line}" for line in report.command_diff]
    if report.gauges_diff:
        lines.append("  gauges:")
        lines += [f"    {line}" for line in report.gauges_diff]
    if report.needs_tick_diff:
        lines.append(f"  {report.needs_tick_diff}")
    if report.state_diff:
        lines.append(f"  state after tick {report.state_tick} (expected = logged snapshot, got = replayed):")
        lines += [f"    {line}" for line in report.state_diff]
    return "\n".join(lines)
