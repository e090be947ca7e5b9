"""Replay of router logs and fleet directories: what ``replay.verify`` does for a core, for the router.

- ``verify_router``: feed every logged ``RouterTickInputs`` to a fresh ``Router``, compare each tick's digest and
  check each snapshot byte for byte; the first divergent tick gets a field-level diff (``replay.diff``).
- ``bisect_router``: the first tick after which ``Router.check_invariants`` fails.
- ``router_at``: the router after a tick, restored from the nearest snapshot.
- ``verify_fleet``: the router log and every replica log of a fleet directory (``<dir>/router.log``,
  ``<dir>/replica-<i>/incarnation-<n>.tlog``).

Each returns ``replay.ReplayReport``, so ``tickloom replay`` prints and exits for a router log as for an engine log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import msgspec

from tickloom.events import LogCorrupt, LogError, SnapshotRecord
from tickloom.fleet.router import Router, RouterSnapshot, decode_router_snapshot, encode_router_snapshot
from tickloom.fleet.router_events import RouterTickRecord
from tickloom.fleet.router_log import RouterLogReader
from tickloom.replay import ReplayReport, verify
from tickloom.replay.diff import diff_commands, summarise_inputs, value_diff
from tickloom.replay.verify import mark_unreadable

ROUTER_LOG = "router.log"
_REPLICA_DIR = re.compile(r"^replica-(\d+)$")
_INCARNATION_LOG = re.compile(r"^incarnation-(\d+)\.tlog$")


def replica_dir(fleet_dir: str | os.PathLike[str], index: int) -> Path:
    return Path(fleet_dir) / f"replica-{index}"


def incarnation_log(fleet_dir: str | os.PathLike[str], index: int, incarnation: int) -> Path:
    return replica_dir(fleet_dir, index) / f"incarnation-{incarnation}.tlog"


def replica_logs(fleet_dir: str | os.PathLike[str]) -> list[tuple[int, int, Path]]:
    """(replica, incarnation, path) of every replica log in a fleet directory, in that order."""
    found = []
    for sub in Path(fleet_dir).iterdir():
        m = _REPLICA_DIR.match(sub.name)
        if m is None or not sub.is_dir():
            continue
        for log in sub.iterdir():
            n = _INCARNATION_LOG.match(log.name)
            if n is not None:
                found.append((int(m.group(1)), int(n.group(1)), log))
    return sorted(found)


def _header_fields(report: ReplayReport, reader: RouterLogReader) -> None:
    h = reader.header
    report.engine_version, report.schema_hash = h.engine_version, h.schema_hash
    report.format_version, report.digest_version = h.format_version, h.digest_version


@contextlib.contextmanager
def _reporting(report: ReplayReport) -> Iterator[None]:
    """Time the replay into ``report``; a log that cannot be read makes it "unreadable" (as ``replay.verify``)."""
    start = time.perf_counter()
    try:
        yield
    except LogError as exc:
        mark_unreadable(report, exc)
    finally:
        report.seconds = time.perf_counter() - start


def verify_router(path: str | os.PathLike[str]) -> ReplayReport:
    """Replay a router log on a fresh router; "identical", or the first divergent tick with a diff."""
    report = ReplayReport("identical", os.fspath(path))
    with _reporting(report), RouterLogReader(path) as reader:
        _header_fields(report, reader)
        router = Router(reader.config)
        for info, record in reader.router_frames():
            if isinstance(record, SnapshotRecord):
                if record.tick != router.tick_no:
                    raise LogCorrupt(reader.path, info.offset, info.tick,
                                     f"a snapshot of tick {record.tick} where the log is at tick {router.tick_no}")
                report.snapshots_checked += 1
                if encode_router_snapshot(router.snapshot()) != record.state:
                    report.status = "divergent"
                    report.first_divergent_tick = record.tick
                    report.error = f"the replayed router after tick {record.tick} differs from the logged snapshot"
                    report.state_tick = record.tick
                    value_diff("router", _logged_snapshot(reader, info.offset, record), router.snapshot(),
                               report.state_diff)
                    break
                continue
            logged = record.outputs
            try:
                out = router.tick(record.inputs)
            except Exception as exc:  # reported with the tick: replay goes no further
                report.status = "divergent"
                report.first_divergent_tick = record.inputs.tick
                report.error = f"the router raised at tick {record.inputs.tick}: {type(exc).__name__}: {exc}"
                report.inputs = summarise_inputs(cast(Any, record.inputs.inputs))
                break
            if out.digest != logged.digest or out.tick != logged.tick:
                report.status = "divergent"
                report.first_divergent_tick = record.inputs.tick
                report.inputs = summarise_inputs(cast(Any, record.inputs.inputs))
                report.command_diff = diff_commands(cast(Any, logged.commands), cast(Any, out.commands))
                value_diff("gauges", logged.gauges, out.gauges, report.gauges_diff)
                break
            if logged.commands != out.commands or logged.gauges != out.gauges:
                raise LogCorrupt(reader.path, info.offset, info.tick,
                                 "the logged decisions or gauges do not match the logged digest")
            report.ticks += 1
            report.rows += len(out.commands)
        if report.status == "identical":
            report.torn_bytes = reader.tail.torn_bytes
    return report


def _logged_snapshot(reader: RouterLogReader, offset: int, record: SnapshotRecord) -> RouterSnapshot:
    try:
        return decode_router_snapshot(record.state)
    except (msgspec.MsgspecError, RecursionError) as exc:
        raise LogCorrupt(reader.path, offset, record.tick, f"the snapshot state does not decode: {exc}") from exc


def bisect_router(path: str | os.PathLike[str], check: Callable[[Router], None] | None = None) -> ReplayReport:
    """Replay every tick and run ``check`` (default ``Router.check_invariants``) after each: "clean", or
    "violation" naming the first tick that fails."""
    report = ReplayReport("clean", os.fspath(path))
    checker = check or Router.check_invariants
    with _reporting(report), RouterLogReader(path) as reader:
        _header_fields(report, reader)
        router = Router(reader.config)
        for record in reader.router_ticks():
            try:
                out = router.tick(record.inputs)
                checker(router)
            except Exception as exc:  # the violation is the report
                report.status = "violation"
                report.first_divergent_tick = record.inputs.tick
                report.error = f"{type(exc).__name__}: {exc}"
                report.inputs = summarise_inputs(cast(Any, record.inputs.inputs))
                break
            report.ticks += 1
            report.rows += len(out.commands)
        report.torn_bytes = reader.tail.torn_bytes
    return report


def router_at(path: str | os.PathLike[str], tick: int) -> Router:
    """The router as it was after ``tick``, from the nearest snapshot at or before it. ``ValueError`` if the log
    ends before ``tick``; ``LogError`` if it cannot be read."""
    with RouterLogReader(path) as reader:
        info = reader.nearest_snapshot(tick)
        if info is not None:
            snapshot = reader.snapshot_record(info)
            router = Router.from_snapshot(_logged_snapshot(reader, info.offset, snapshot))
            start: int | None = info.end
        else:
            router = Router(reader.config)
            start = None
        if router.tick_no >= tick:
            return router
        for record in reader.router_records(start):
            if isinstance(record, RouterTickRecord):
                router.tick(record.inputs)
                if record.inputs.tick >= tick:
                    return router
    raise ValueError(f"{os.fspath(path)}: the router log ends at tick {router.tick_no}, before tick {tick}")


# -- a fleet directory ------------------------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class FleetReport:
    """The router log's report and each replica log's, worst status first in ``status``."""

    path: str
    router: ReplayReport
    replicas: list[tuple[int, int, ReplayReport]]

    @property
    def reports(self) -> list[ReplayReport]:
        return [self.router, *(r for _, _, r in self.replicas)]

    @property
    def exit_code(self) -> int:
        return max(r.exit_code for r in self.reports)

    @property
    def status(self) -> str:
        return max(self.reports, key=lambda r: r.exit_code).status

    def to_json(self) -> dict[str, object]:
        return {"status": self.status, "path": self.path, "router": self.router.to_json(),
                "replicas": [{"replica": i, "incarnation": n, **r.to_json()} for i, n, r in self.replicas]}

    def format_text(self) -> str:
        lines = [f"fleet {self.path}: {self.status}", f"  router: {self.router.format_text()}"]
        for index, incarnation, report in self.replicas:
            text = report.format_text().replace("\n", "\n    ")
            lines.append(f"  replica {index}, incarnation {incarnation}: {text}")
        if not self.replicas:
            lines.append("  (no replica logs)")
        return "\n".join(lines)


def verify_fleet(fleet_dir: str | os.PathLike[str]) -> FleetReport:
    """Verify ``<dir>/router.log`` and every replica log under ``<dir>``."""
    router = verify_router(Path(fleet_dir) / ROUTER_LOG)
    replicas = [(i, n, verify(path)) for i, n, path in replica_logs(fleet_dir)]
    return FleetReport(os.fspath(fleet_dir), router, replicas)


def is_fleet_dir(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / ROUTER_LOG).is_file()
