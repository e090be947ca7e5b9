"""The fleet on a local Ray cluster: 3 replicas of the stub model, a replica killed mid-run, every log replayed.

The tests are sync and drive the asyncio front end with ``asyncio.run`` (pytest's trio mode would run ``async def``
tests under trio). One Ray cluster serves the module.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
from pathlib import Path

import pytest

from tickloom import EngineConfig, RequestOutput, RequestRejected, SamplingParams
from tickloom.fleet.front import Fleet, FleetConfig, ReplicaDied
from tickloom.fleet.router_events import Lost, ReplicaDown, ReplicaUp, Route
from tickloom.fleet.router_log import RouterLogReader
from tickloom.fleet.router_replay import ROUTER_LOG, replica_logs, verify_fleet

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

STUB = EngineConfig(model="stub", stub_step_time=0.004, block_size=16, num_blocks=2048)
"""One stub step takes 4 ms: a 300-request run lasts long enough to kill a replica in the middle of it."""


def shared_prefix_prompts(requests: int, families: int) -> list[list[int]]:
    """Prompts of ``families`` 4-block prefixes, each with a short tail of its own."""
    return [[1 + (i % families)] * 64 + [20 + (i * 7) % 70, 20 + (i * 13) % 70, 20 + i % 70]
            for i in range(requests)]


class Outcomes:
    """Each request's frames and ending, as its client saw them."""

    def __init__(self) -> None:
        self.frames: dict[str, list[RequestOutput]] = collections.defaultdict(list)
        self.errors: dict[str, list[BaseException]] = collections.defaultdict(list)
        self.after_end: list[str] = []

    async def run(self, fleet: Fleet, rid: str, prompt: list[int], params: SamplingParams) -> None:
        try:
            async for out in fleet.generate(prompt, params, request_id=rid):
                if any(f.finished for f in self.frames[rid]) or self.errors[rid]:
                    self.after_end.append(rid)
                self.frames[rid].append(out)
        except ReplicaDied as exc:
            self.errors[rid].append(exc)

    def endings(self, rid: str) -> int:
        return sum(f.finished for f in self.frames[rid]) + len(self.errors[rid])

    def hit_rate(self) -> float:
        usages = [f.usage for frames in self.frames.values() for f in frames if f.finished and f.usage]
        return sum(u.cached_prompt_tokens for u in usages) / sum(u.prompt_tokens for u in usages)


def routes(fleet_dir: Path) -> tuple[dict[str, int], list[object], list[object]]:
    """request -> replica, every replica event input and every Lost, from the router log."""
    routed: dict[str, int] = {}
    events: list[object] = []
    lost: list[object] = []
    with RouterLogReader(fleet_dir / ROUTER_LOG) as reader:
        for record in reader.router_ticks():
            events += [i for i in record.inputs.inputs if isinstance(i, ReplicaDown | ReplicaUp)]
            for command in record.outputs.commands:
                if isinstance(command, Route):
                    routed[command.request_id] = command.replica
                elif isinstance(command, Lost):
                    lost.append(command)
    return routed, events, lost


async def run_fleet(fleet_dir: Path, prompts: list[list[int]], policy: str, *, kill_at: int | None = None,
                    concurrency: int = 24) -> Outcomes:
    outcomes = Outcomes()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    config = FleetConfig(replicas=3, fleet_dir=str(fleet_dir), policy=policy, replica_cpus=1.0)
    async with Fleet.open(STUB, config) as fleet:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with gate:
                await outcomes.run(fleet, f"r{i}", prompts[i], params)

        tasks = []
        for i in range(len(prompts)):
            if i == kill_at:
                while sum(bool(f) for f in outcomes.frames.values()) < kill_at - concurrency:
                    await asyncio.sleep(0.005)
                fleet.kill_replica(1)
                # the rest arrive once replica 1 has come back, so the run shows it rejoining
                while not (fleet.replicas[1].live and fleet.replicas[1].incarnation == 1):
                    await asyncio.sleep(0.02)
            tasks.append(asyncio.ensure_future(one(i)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
    return outcomes


def test_a_fleet_survives_a_replica_killed_mid_run_and_every_log_replays(ray_cluster: None, tmp_path: Path) -> None:
    prompts = shared_prefix_prompts(300, 20)
    outcomes = asyncio.run(run_fleet(tmp_path / "fleet", prompts, "affinity", kill_at=150))

    # every request ends exactly once, nothing comes after its end
    assert [rid for i in range(300) if outcomes.endings(rid := f"r{i}") != 1] == []
    assert outcomes.after_end == []

    # the requests lost are exactly those open on replica 1 when it died, and each says so
    routed, events, lost = routes(tmp_path / "fleet")
    assert [type(e).__name__ for e in events] == ["ReplicaDown", "ReplicaUp"]
    assert events[0].replica == 1 and events[1] == ReplicaUp(1, 1)
    failed = {rid for rid, errors in outcomes.errors.items() if errors}
    assert failed, "the kill came mid-run: some requests were open on replica 1"
    assert failed == {rid for command in lost for rid in command.request_ids}
    assert {routed[rid] for rid in failed} == {1}
    for rid in failed:
        message = str(outcomes.errors[rid][0])
        assert "replica 1 died" in message and "not retried" in message
    # the others all finished normally, and replica 1 took requests again after it rejoined
    finished = [rid for rid, frames in outcomes.frames.items() if frames and frames[-1].finished]
    assert len(finished) == 300 - len(failed)
    assert all(outcomes.frames[rid][-1].finish_reason == "length" for rid in finished)
    assert any(routed[f"r{i}"] == 1 for i in range(150, 300))

    # the router log and every replica log (both incarnations of replica 1) replay identical
    report = verify_fleet(tmp_path / "fleet")
    assert report.status == "identical", report.format_text()
    assert [(i, n) for i, n, _ in replica_logs(tmp_path / "fleet")] == [(0, 0), (1, 0), (1, 1), (2, 0)]


def test_affinity_routing_hits_the_prefix_cache_more_than_round_robin(ray_cluster: None, tmp_path: Path) -> None:
    prompts = shared_prefix_prompts(150, 25)  # 25 families: round-robin sends each family to all 3 replicas
    affinity = asyncio.run(run_fleet(tmp_path / "affinity", prompts, "affinity"))
    round_robin = asyncio.run(run_fleet(tmp_path / "round-robin", prompts, "round-robin"))
    assert affinity.hit_rate() > round_robin.hit_rate(), (affinity.hit_rate(), round_robin.hit_rate())
    assert verify_fleet(tmp_path / "affinity").status == "identical"
    assert verify_fleet(tmp_path / "round-robin").status == "identical"


def test_the_front_end_has_the_engines_api(ray_cluster: None, tmp_path: Path) -> None:
    async def main() -> None:
        async with Fleet.open(STUB, FleetConfig(replicas=2, fleet_dir=str(tmp_path / "f"))) as fleet:
            text = await fleet.complete("Hello there", SamplingParams(max_tokens=5, temperature=0.0, logprobs=1))
            assert text.finished and len(text.token_ids) == 5 and text.usage is not None
            assert text.usage.prompt_tokens == len("Hello there")
            assert text.logprobs is not None and len(text.logprobs) == 5, "every frame's logprobs, as Engine's"
            with pytest.raises(RequestRejected, match=r"use Fleet\.complete_n\(\) for n > 1"):
                await fleet.complete([5] * 20, SamplingParams(max_tokens=3, n=2))
            pair = await fleet.complete_n([5] * 20, SamplingParams(max_tokens=3, n=2, seed=1))
            assert [(out.index, len(out.token_ids)) for out in pair] == [(0, 3), (1, 3)]
            choices = [out async for out in fleet.generate([5] * 20, SamplingParams(max_tokens=3, n=2, seed=1))]
            assert sorted(out.index for out in choices if out.finished) == [0, 1]
            async with fleet.stream([5] * 20, SamplingParams(max_tokens=200, ignore_eos=True),
                                    request_id="early") as stream:
                first = await stream.__anext__()
                assert not first.finished
            dropped = fleet.generate([6] * 20, SamplingParams(max_tokens=500, ignore_eos=True), request_id="dropped")
            assert not (await dropped.__anext__()).finished
            del dropped  # left unfinished: the request is cancelled, and the router told it ended
            gc.collect()
            for _ in range(200):
                await asyncio.sleep(0.01)
                if "dropped" not in fleet._router().router.open:
                    break
            assert "dropped" not in fleet._router().router.open
            with pytest.raises(RequestRejected, match="request_id"):
                fleet.generate([1], request_id="")
            with pytest.raises(RequestRejected, match="vocab_size"):
                await fleet.complete([500], SamplingParams(max_tokens=2))  # the replica's engine refuses it
            with pytest.raises(RequestRejected, match="empty"):
                fleet.generate([])

    asyncio.run(main())
    report = verify_fleet(tmp_path / "f")
    assert report.status == "identical", report.format_text()


def test_bench_fleet_compares_fleet_sizes_and_times_the_router(ray_cluster: None,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from tickloom.tools.cli import main

    assert main(["bench", "fleet", "--model", "stub", "--requests", "6", "--max-tokens", "4",
                 "--router-requests", "50", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    fleets = [r for r in rows if r["bench"] == "fleet"]
    assert [r["replicas"] for r in fleets] == [1, 3] and all(r["replay"] == "identical" for r in fleets)
    assert all(r["tokens"] == 24 for r in fleets)
    assert sorted((r["replicas"], r["logged"]) for r in rows if r["bench"] == "router") == [
        (3, False), (3, True), (16, False), (16, True)]


def test_a_fleet_whose_replicas_cannot_be_placed_fails_to_open_with_a_clear_error(ray_cluster: None,
                                                                                   tmp_path: Path) -> None:
    from tickloom.fleet.front import FleetError

    async def main() -> None:
        config = FleetConfig(replicas=2, fleet_dir=str(tmp_path / "f"), replica_cpus=64.0, start_timeout=1.0)
        async with Fleet.open(STUB, config):
            raise AssertionError("opened")

    with pytest.raises(FleetError, match=r"replica 0 did not start within 1\.0 s"):
        asyncio.run(main())
