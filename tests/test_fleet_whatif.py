"""The fleet what-if: a router log's arrivals re-routed under another policy or replica count, each replica the
core-level simulator. The fleet directory is made without Ray: a logged router and each replica's core run in the
simulator (``record_core_run``), which writes the same logs a fleet does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tickloom.engine.core import CoreConfig
from tickloom.events import RequestArrived, SamplingSpec
from tickloom.fleet.logged_router import LoggedRouter
from tickloom.fleet.router_events import Route, RouterConfig
from tickloom.fleet.router_replay import ROUTER_LOG, incarnation_log, verify_fleet
from tickloom.fleet.whatif import fleet_whatif
from tickloom.replay.record import record_core_run
from tickloom.tools.cli import main

CORE = CoreConfig(num_blocks=512, block_size=16, vocab_size=512, eos_token_ids=(2,), max_seq_len=512)
TICK_NS = 1_000_000


def synthetic_fleet(fleet_dir: Path, requests: int = 60, families: int = 10, replicas: int = 3) -> dict[str, int]:
    """A fleet directory as a live affinity fleet would leave it; request -> the replica it was routed to."""
    fleet_dir.mkdir()
    clock = [0]
    router = LoggedRouter(RouterConfig(replicas=replicas), fleet_dir / ROUTER_LOG, lambda: clock[0])
    scripts: list[dict[int, list[RequestArrived]]] = [{} for _ in range(replicas)]
    routed: dict[str, int] = {}
    for i in range(requests):
        tick = 2 * i
        clock[0] = tick * TICK_NS
        rid = f"r{i}"
        prompt = [10 + i % families] * 48 + [100 + i, 200 + i]
        [route] = [c for c in router.route(router.arrival(rid, prompt)) if isinstance(c, Route)]
        routed[rid] = route.replica
        scripts[route.replica].setdefault(tick, []).append(
            RequestArrived(rid, prompt, SamplingSpec(max_tokens=8, ignore_eos=True), 7 + i))
    for rid in routed:
        router.finished(rid)
    router.close()
    for index, script in enumerate(scripts):
        path = incarnation_log(fleet_dir, index, 0)
        path.parent.mkdir(parents=True)
        record_core_run(path, CORE, script)
    return routed


@pytest.fixture()
def fleet(tmp_path: Path) -> Path:
    synthetic_fleet(tmp_path / "fleet")
    assert verify_fleet(tmp_path / "fleet").status == "identical"
    return tmp_path / "fleet"


def test_the_original_column_is_what_the_logs_say(fleet: Path) -> None:
    result = fleet_whatif(fleet, {})
    original = result.original
    assert (original.requests, original.finished, original.completion_tokens) == (60, 60, 480)
    assert sum(original.per_replica) == 60 and result.changes == {}
    assert 0 < original.hit_rate < 1


def test_round_robin_spreads_evenly_and_loses_the_prefix_cache(fleet: Path) -> None:
    affinity = fleet_whatif(fleet, {})
    round_robin = fleet_whatif(fleet, {"policy": "round-robin"})
    assert round_robin.whatif.per_replica == [20, 20, 20]
    assert round_robin.changes == {"policy": ("affinity", "round-robin")}
    assert round_robin.whatif.hit_rate < affinity.whatif.hit_rate
    assert round_robin.whatif.finished == affinity.whatif.finished == 60


def test_the_replica_count_changes_where_requests_go_and_how_fast_they_finish(fleet: Path) -> None:
    one = fleet_whatif(fleet, {"replicas": 1}).whatif
    five = fleet_whatif(fleet, {"replicas": 5}).whatif
    assert one.per_replica == [60] and len(five.per_replica) == 5 and sum(five.per_replica) == 60
    assert one.hit_rate >= fleet_whatif(fleet, {}).whatif.hit_rate  # one cache sees every family
    assert one.completion_tokens == five.completion_tokens == 480
    assert one.duration_ns > five.duration_ns  # one replica's batches are five replicas' work


def test_only_router_fields_can_be_changed_and_values_are_checked(fleet: Path) -> None:
    with pytest.raises(ValueError, match="not num_blocks"):
        fleet_whatif(fleet, {"num_blocks": 3})
    with pytest.raises(ValueError, match="policy"):
        fleet_whatif(fleet, {"policy": "random"})


def test_cli_whatif_on_a_fleet_directory_or_its_router_log(fleet: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["whatif", str(fleet), "--set", "policy=round-robin", "--set", "replicas=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["whatif"]["policy"] == "round-robin" and out["whatif"]["requests_per_replica"] == [30, 30]
    assert main(["whatif", str(fleet / ROUTER_LOG), "--set", "load_slack=0"]) == 0
    text = capsys.readouterr().out
    assert "load_slack 4 -> 0" in text and "prefix_cache_hit_rate" in text
    assert main(["whatif", str(fleet), "--set", "num_blocks=3"]) == 64
    assert main(["whatif", str(fleet), "--plot", "x.png"]) == 64
