"""The router's log: the engine log's frame format with router records, exact replay, bisect, seek, inspect and the
``tickloom replay``/``inspect`` dispatch. No Ray here: the router is pure."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from tickloom.engine.core import CoreConfig
from tickloom.events import LogExists, LogIncompatible, LogReader, known_schema_hashes
from tickloom.events.frames import HEADER_SIZE, pack_frame
from tickloom.fleet.logged_router import LoggedRouter
from tickloom.fleet.router import Router
from tickloom.fleet.router_events import (
    ROUTER_SCHEMA_HASH,
    LoadReport,
    RouterConfig,
    RouterTickRecord,
    known_router_schemas,
)
from tickloom.fleet.router_log import RouterLogReader, RouterLogWriter, is_router_log
from tickloom.fleet.router_replay import bisect_router, router_at, verify_fleet, verify_router
from tickloom.replay.record import arrival, record_core_run
from tickloom.tools.cli import main

FIXTURES = Path(__file__).parent / "fixtures"
ENGINE_LOG = FIXTURES / f"schema-{known_schema_hashes()[0]}.tlog"


def write_router_log(path: Path, *, policy: str = "affinity", snapshot_every: int = 4, requests: int = 24,
                     bad_report_at: int | None = None) -> LoggedRouter:
    """A deterministic router session: arrivals over 6 prefix families, finishes, reports, a replica down and up."""
    clock = itertools.count(1_000_000, 250_000)
    lr = LoggedRouter(RouterConfig.checked({"replicas": 3, "policy": policy}), path, lambda: next(clock),
                      snapshot_every=snapshot_every)
    for i in range(requests):
        prompt = [i % 6] * 48 + [100 + i] * 5
        for command in lr.route(lr.arrival(f"r{i}", prompt)):
            del command
        if i % 3 == 2:
            lr.finished(f"r{i - 2}")
            lr.report(LoadReport(i % 3, i % 4, 1, 50 - i if i != bad_report_at else -1))
        if i == 10:
            lr.down(1, "actor died")
        if i == 15:
            lr.up(1, 1)
    lr.close()
    return lr


def test_a_router_log_replays_identical_with_its_snapshots(tmp_path: Path) -> None:
    path = tmp_path / "router.log"
    lr = write_router_log(path)
    report = verify_router(path)
    assert report.status == "identical", report.format_text()
    assert report.ticks == lr.router.tick_no + 1 and report.snapshots_checked == (lr.router.tick_no + 1) // 4
    assert report.rows > 24  # a route per arrival, and the Lost of the replica that went down
    assert report.schema_hash == ROUTER_SCHEMA_HASH


def test_the_router_schema_is_known_and_the_first_schemas_log_still_replays() -> None:
    assert ROUTER_SCHEMA_HASH in known_router_schemas()
    for schema in known_router_schemas():
        fixture = FIXTURES / f"router-schema-{schema}.log"
        assert fixture.is_file(), f"each known router schema keeps a fixture log: {fixture.name}"
        assert verify_router(fixture).status == "identical"


def test_a_torn_tail_is_dropped_and_the_rest_replays(tmp_path: Path) -> None:
    path = tmp_path / "router.log"
    write_router_log(path)
    size = path.stat().st_size
    os.truncate(path, size - 5)
    report = verify_router(path)
    assert report.status == "identical" and report.torn_bytes > 0


def test_a_changed_decision_is_the_first_divergent_tick_with_a_diff(tmp_path: Path) -> None:
    """Log a round-robin session under a header that says affinity: replay must find the first tick where the
    two policies part, and name the differing field in the diff."""
    rr = tmp_path / "rr.log"
    write_router_log(rr, policy="round-robin", snapshot_every=0)
    forged = tmp_path / "forged.log"
    with RouterLogReader(rr) as reader:
        records = list(reader.router_ticks())
    with RouterLogWriter(forged, RouterConfig(replicas=3, policy="affinity")) as writer:
        for record in records:
            writer.append_router_tick(record)
    expected = Router(RouterConfig(replicas=3, policy="affinity"))
    first = next(r.inputs.tick for r in records if expected.tick(r.inputs).digest != r.outputs.digest)
    report = verify_router(forged)
    assert report.status == "divergent" and report.first_divergent_tick == first
    assert "commands[0].reason: expected 'round-robin', got 'load'" in report.command_diff, report.command_diff
    assert report.exit_code == 1


def test_a_snapshot_that_differs_from_the_replayed_router_is_divergent(tmp_path: Path) -> None:
    path = tmp_path / "router.log"
    write_router_log(path, snapshot_every=0)
    with RouterLogReader(path) as reader:
        records = list(reader.router_ticks())
    forged = tmp_path / "forged.log"
    other = Router(RouterConfig(replicas=3, policy="round-robin"))
    from tickloom.events import SnapshotRecord
    from tickloom.fleet.router import encode_router_snapshot

    with RouterLogWriter(forged, RouterConfig(replicas=3)) as writer:
        writer.append_router_tick(records[0])
        other.tick(records[0].inputs)
        writer.append_snapshot(SnapshotRecord(0, records[0].outputs.digest, encode_router_snapshot(other.snapshot())))
    report = verify_router(forged)
    assert report.status == "divergent" and report.state_tick == 0
    assert any("router.config.policy" in line for line in report.state_diff), report.state_diff


def test_bisect_names_the_first_tick_that_breaks_an_invariant(tmp_path: Path) -> None:
    clean = tmp_path / "clean.log"
    write_router_log(clean)
    assert bisect_router(clean).status == "clean"
    bad = tmp_path / "bad.log"
    lr = write_router_log(bad, bad_report_at=5)
    del lr
    report = bisect_router(bad)
    assert report.status == "violation" and "negative" in (report.error or "")
    with RouterLogReader(bad) as reader:
        tick = next(r.inputs.tick for r in reader.router_ticks()
                    if any(isinstance(i, LoadReport) and i.free_blocks < 0 for i in r.inputs.inputs))
    assert report.first_divergent_tick == tick


def test_router_at_seeks_from_the_nearest_snapshot(tmp_path: Path) -> None:
    path = tmp_path / "router.log"
    write_router_log(path, snapshot_every=4)
    with RouterLogReader(path) as reader:
        config = reader.config
        records = list(reader.router_ticks())
    for tick in (0, 3, 6, len(records) - 1):
        direct = Router(config)
        for record in records[: tick + 1]:
            direct.tick(record.inputs)
        assert router_at(path, tick).snapshot() == direct.snapshot()
    with pytest.raises(ValueError, match="ends at tick"):
        router_at(path, len(records) + 5)


def test_logs_are_never_overwritten_and_readers_refuse_the_other_kind(tmp_path: Path) -> None:
    path = tmp_path / "router.log"
    write_router_log(path)
    with pytest.raises(LogExists):
        LoggedRouter(RouterConfig(replicas=1), path, lambda: 0)
    with pytest.raises(LogIncompatible, match="schema"):
        LogReader(path)
    engine_log = ENGINE_LOG
    with pytest.raises(LogIncompatible, match="kind"):
        RouterLogReader(engine_log)
    assert is_router_log(path) and not is_router_log(engine_log) and not is_router_log(tmp_path / "missing")


def test_cli_replay_and_inspect_dispatch_a_router_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "router.log"
    write_router_log(path)
    assert main(["replay", str(path)]) == 0
    assert capsys.readouterr().out.startswith("identical: ")
    assert main(["replay", str(path), "--bisect"]) == 0
    assert capsys.readouterr().out.startswith("clean: ")
    assert main(["replay", str(path), "--until", "11", "--dump"]) == 0
    out = capsys.readouterr().out
    assert "router after tick 11" in out and "replica 1: down" in out
    assert main(["inspect", str(path), "--request", "r4"]) == 0
    out = capsys.readouterr().out
    assert "router log" in out and "routed to replica" in out and "lost with replica 1" in out
    assert main(["inspect", str(path), "--ticks", "0:3"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[3].split()[0] == "tick" and [line.split()[0] for line in table[4:]] == ["0", "1", "2"]
    assert main(["replay", str(path), "--full"]) == 64


def test_cli_replay_of_a_fleet_directory_checks_every_log(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    fleet = tmp_path / "fleet"
    (fleet / "replica-0").mkdir(parents=True)
    write_router_log(fleet / "router.log")
    engine_log = fleet / "replica-0" / "incarnation-0.tlog"
    record_core_run(engine_log, CoreConfig(num_blocks=64, vocab_size=512, max_seq_len=256),
                    {0: [arrival("a", 20, 4)], 1: [arrival("b", 30, 4)]})
    report = verify_fleet(fleet)
    assert report.status == "identical" and [(i, n) for i, n, _ in report.replicas] == [(0, 0)]
    assert main(["replay", str(fleet), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "identical" and out["replicas"][0]["status"] == "identical"
    # a damaged replica log makes the directory's status that log's
    damaged = fleet / "replica-0" / "incarnation-1.tlog"
    data = bytearray(ENGINE_LOG.read_bytes())
    data[HEADER_SIZE + 3] ^= 0xFF
    data += pack_frame("tick", 99, b"\x90")
    damaged.write_bytes(bytes(data))
    assert main(["replay", str(fleet)]) == 2
    assert "replica 0, incarnation 1: unreadable" in capsys.readouterr().out


def test_records_are_router_ticks(tmp_path: Path) -> None:
    path = tmp_path / "router.log"
    write_router_log(path, snapshot_every=0)
    with RouterLogReader(path) as reader:
        assert all(isinstance(r, RouterTickRecord) for r in reader.router_records())
