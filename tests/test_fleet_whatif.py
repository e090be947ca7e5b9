"""The fleet what-if: a router log's arrivals re-routed under another policy or replica count, each replica the
core-level simulator. The fleet directory is made without Ray: a logged router and each replica's core run in the
simulator (``record_core_run``), which writes the same logs a fleet does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
import trio.testing
from engine_helpers import stub_config

from tickloom.engine.core import CoreConfig
from tickloom.events import RequestArrived, SamplingSpec
from tickloom.fleet.logged_router import LoggedRouter
from tickloom.fleet.router_events import Route, RouterConfig
from tickloom.fleet.router_replay import ROUTER_LOG, incarnation_log, verify_fleet
from tickloom.fleet.whatif import fleet_whatif
from tickloom.replay.record import record_core_run
from tickloom.tools.cli import main
from tickloom.tools.commands._whatif_validate import FIGURES, rerun_fleet, run_fleet_for_real

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


# -- a stub fleet, predicted and re-run for real ----------------------------------------------------------------
STUB_FLEET = dict(num_blocks=48, block_size=8, max_seq_len=128, max_batch_size=6, stub_step_time=0.004)


def stub_fleet(fleet_dir: Path, replicas: int = 3) -> Path:
    """A fleet directory as stub replicas leave it: 36 requests in six prompt families, arriving in bursts, routed
    by the affinity router, every replica a stub engine, all in virtual time."""
    arrivals = []
    for i in range(36):
        prompt = [10 + i % 6] * 40 + [50 + i % 40, 60 + i % 7]
        at = int((0.0031 * i + 0.0213 * (i // 12)) * 1e9)
        arrivals.append((at, RequestArrived(f"s{i}", prompt, SamplingSpec(max_tokens=6 + (i * 7) % 30), 11 + i)))
    engine = stub_config(fleet_dir / "unused.tlog", **STUB_FLEET)
    router = RouterConfig(replicas=replicas, block_size=8)
    trio.run(rerun_fleet, arrivals, router, engine, fleet_dir, clock=trio.testing.MockClock(autojump_threshold=0))
    return fleet_dir


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stub_fleet(tmp_path_factory.mktemp("stubs") / "fleet")


def _quantiles(summary: dict[str, object]) -> dict[str, float]:
    out = {}
    for key in ("ttft_ms_p50", "ttft_ms_p90", "itl_ms_p50", "itl_ms_p90"):
        value = summary[key]
        assert isinstance(value, float)
        out[key] = value
    return out


@pytest.mark.slow
@pytest.mark.parametrize("changes", [{"replicas": 2}, {"replicas": 5}, {"policy": "round-robin"},
                                     {"policy": "least-loaded"}])
def test_stub_fleet_predictions_within_ten_percent(stubs: Path, changes: dict[str, object]) -> None:
    """The fleet what-if on a stub fleet predicts p50 and p90 TTFT and inter-token latency within 10% of the same
    arrivals really run through that router and stub replicas."""
    result = fleet_whatif(stubs, changes)
    assert result.model.source == "stub" and not result.extrapolated
    measured, clock = run_fleet_for_real(stubs, changes)
    assert clock.startswith("virtual")
    predicted, real = _quantiles(result.whatif.summary()), _quantiles(measured.summary())
    for key, truth in real.items():
        assert predicted[key] == pytest.approx(truth, rel=0.10), key
    assert result.whatif.completion_tokens == measured.completion_tokens
    assert result.whatif.per_replica == measured.per_replica


def test_stub_fleet_model_intervals_and_validate(stubs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = fleet_whatif(stubs, {"replicas": 2})
    assert result.model.source == "stub" and result.model.why.startswith("the log was written by the stub model")
    summary = result.whatif.summary()
    assert result.intervals and all(lo == hi == summary[k] for k, (lo, hi) in result.intervals.items())
    assert "step model: stub" in result.format_text()
    assert main(["whatif", str(stubs), "--set", "replicas=2", "--validate"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("validate: "))
    assert "stub replicas under trio's MockClock" in lines[start]
    assert lines[start + 1].split() == ["predicted", "interval", "measured", "ratio"]
    assert [line[:22].strip() for line in lines[start + 2 : start + 7]] == [label for label, _ in FIGURES]
    assert main(["whatif", str(stubs), "--set", "replicas=2", "--validate", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step_model"]["source"] == "stub"
    assert [r["key"] for r in report["validate"]["rows"]] == [key for _, key in FIGURES]
    assert all(0.9 <= r["ratio"] <= 1.1 for r in report["validate"]["rows"])


def test_validate_needs_a_stub_fleet(fleet: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["whatif", str(fleet), "--set", "replicas=2", "--validate"]) == 64
    assert "re-runs a fleet on the stub only" in capsys.readouterr().err
