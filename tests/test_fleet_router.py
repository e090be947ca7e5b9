"""The fleet's router: a pure state machine. One test per rule: each policy's choice and tie-breaks, load and its
reports, replicas going down and coming back, refusals, the remembered-prefix bound, the digest and snapshots."""

from __future__ import annotations

import pytest

from tickloom.engine.core.blocks import ROOT_HASH, chain_hashes, pack_tokens
from tickloom.fleet.logged_router import prompt_block_hashes
from tickloom.fleet.router import Router, RouterInvariantError
from tickloom.fleet.router_events import (
    Arrival,
    Finished,
    LoadReport,
    Lost,
    Refuse,
    ReplicaDown,
    ReplicaUp,
    Route,
    RouterConfig,
    RouterInput,
    RouterTickInputs,
)


def hashes(prefix: int, blocks: int) -> list[bytes]:
    """``blocks`` block hashes of the prefix family ``prefix`` (shared leading blocks mean shared leading hashes)."""
    return prompt_block_hashes([prefix] * (16 * blocks), 16, "", 64)


class Driver:
    def __init__(self, **config: object) -> None:
        self.router = Router(RouterConfig.checked({"replicas": 3, **config}))

    def tick(self, *inputs: RouterInput) -> list[object]:
        out = self.router.tick(RouterTickInputs(self.router.tick_no + 1, 1000 * (self.router.tick_no + 1),
                                                list(inputs)))
        self.router.check_invariants()
        return list(out.commands)

    def route(self, rid: str, block_hashes: list[bytes] | None = None) -> Route:
        [command] = self.tick(Arrival(rid, block_hashes or [], 16 * len(block_hashes or [])))
        assert isinstance(command, Route), command
        return command

    def report(self, replica: int, waiting: int = 0, running: int = 0, free: int = 100) -> None:
        self.tick(LoadReport(replica, waiting, running, free))


def test_the_affinity_key_is_the_cores_block_hash_chain() -> None:
    prompt = list(range(50))
    assert prompt_block_hashes(prompt, 16, "s", 64) == chain_hashes(ROOT_HASH, pack_tokens(prompt[:48]), 16, "s")
    assert len(prompt_block_hashes(prompt, 16, "", 2)) == 2
    assert prompt_block_hashes(prompt, 16, "a", 64) != prompt_block_hashes(prompt, 16, "b", 64)


def test_affinity_sends_a_shared_prefix_back_to_the_replica_that_holds_it() -> None:
    d = Driver()
    first = d.route("a", hashes(1, 4))
    assert first.reason == "load" and first.matched_blocks == 0
    d.tick(Finished("a"))
    again = d.route("b", hashes(1, 4))
    assert (again.replica, again.reason, again.matched_blocks) == (first.replica, "affinity", 4)


def test_affinity_prefers_the_longer_cached_prefix_then_the_lower_load() -> None:
    d = Driver(load_slack=10)
    long = hashes(1, 4)
    d.router.replicas[0].cached = dict.fromkeys(long[:2])
    d.router.replicas[2].cached = dict.fromkeys(long)
    d.report(2, waiting=3)
    route = d.route("c", long)
    assert (route.replica, route.matched_blocks, route.reason) == (2, 4, "affinity")
    d.router.replicas[1].cached = dict.fromkeys(long)  # an equal prefix on a less loaded replica
    assert d.route("d", long).replica == 1


def test_affinity_gives_way_to_load_past_the_slack() -> None:
    d = Driver(load_slack=2)
    prefix = hashes(7, 3)
    holder = d.route("a", prefix).replica
    d.report(holder, waiting=2)  # load 2 = least (0) + slack: still affinity
    assert d.route("b", prefix).reason == "affinity"
    d.report(holder, waiting=3)  # load 3 > 0 + 2: load wins
    other = d.route("c", prefix)
    assert other.replica != holder and other.reason == "load" and other.matched_blocks == 0


def test_least_loaded_breaks_ties_by_free_blocks_then_index() -> None:
    d = Driver(policy="least-loaded")
    d.report(0, waiting=1, free=500)
    d.report(1, waiting=0, free=10)
    d.report(2, waiting=0, free=20)
    assert d.route("a").replica == 2  # equal load 0: more free blocks
    d.report(2, waiting=1, free=20)  # a is counted in the report now
    d.report(1, waiting=1, free=10)
    assert d.route("b").replica == 0  # all load 1: most free blocks
    d.report(0, running=1, free=20)
    d.report(1, running=1, free=20)
    d.report(2, running=1, free=20)
    assert d.route("c").replica == 0  # all equal: lowest index


def test_requests_routed_since_a_report_count_as_load_until_the_next_report() -> None:
    d = Driver(policy="least-loaded")
    assert [d.route(f"r{i}").replica for i in range(6)] == [0, 1, 2, 0, 1, 2]
    d.report(1, waiting=0)  # replica 1 reports: its two routed requests are in its report (none left)
    assert d.route("x").replica == 1


def test_round_robin_cycles_over_live_replicas() -> None:
    d = Driver(policy="round-robin")
    assert [d.route(f"r{i}").replica for i in range(4)] == [0, 1, 2, 0]
    d.tick(ReplicaDown(2, "test"))
    assert [d.route(f"s{i}").replica for i in range(3)] == [1, 0, 1]


def test_a_replica_going_down_loses_its_open_requests_in_routing_order_and_gets_no_more() -> None:
    d = Driver(policy="round-robin")
    for i in range(6):
        d.route(f"r{i}")
    d.tick(Finished("r1"))
    out = d.tick(ReplicaDown(1, "actor died"))
    assert out == [Lost(1, ["r4"])]
    assert d.tick(ReplicaDown(1, "again")) == []  # down once
    assert {d.route(f"s{i}").replica for i in range(4)} == {0, 2}
    assert d.router.gauges().live == 2


def test_a_late_report_of_a_replica_that_is_down_is_ignored() -> None:
    d = Driver(policy="least-loaded")
    d.tick(ReplicaDown(0, "gone"))
    d.report(0, waiting=0, free=10**6)
    assert d.router.replicas[0].free_blocks == 0
    assert d.route("a").replica == 1


def test_a_rejoined_replica_starts_empty_and_takes_requests_again() -> None:
    d = Driver()
    prefix = hashes(3, 2)
    holder = d.route("a", prefix).replica
    d.tick(ReplicaDown(holder, "gone"))
    assert d.tick(ReplicaUp(holder, 1)) == []
    assert d.router.replicas[holder].cached == {}
    route = d.route("b", prefix)
    assert route.matched_blocks == 0 and route.reason == "load"


def test_a_new_incarnation_of_a_live_replica_loses_what_the_old_one_held() -> None:
    d = Driver(policy="round-robin")
    d.route("a")
    assert d.tick(ReplicaUp(0, 1)) == [Lost(0, ["a"])]
    assert d.tick(ReplicaUp(0, 1)) == []  # the same incarnation again: nothing
    assert d.tick(ReplicaUp(0, 0)) == []  # an older one: ignored
    assert d.router.replicas[0].incarnation == 1


def test_refusals_name_the_reason() -> None:
    d = Driver(replicas=1)
    d.route("a")
    [dup] = d.tick(Arrival("a", [], 1))
    assert isinstance(dup, Refuse) and "already open" in dup.reason
    d.tick(ReplicaDown(0, "gone"))
    [none] = d.tick(Arrival("b", [], 1))
    assert none == Refuse("b", "no replica is live")


def test_remembered_prefixes_are_bounded_least_recently_routed_first() -> None:
    d = Driver(replicas=1, cache_blocks=4)
    first, second = hashes(1, 3), hashes(2, 3)
    d.route("a", first)
    d.route("b", second)
    cached = d.router.replicas[0].cached
    assert list(cached) == [first[2], *second]
    d.route("c", first)  # re-routing refreshes
    assert list(cached) == [second[2], *first]


def test_the_digest_is_a_chain_over_every_decision() -> None:
    def run(policy: str) -> bytes:
        d = Driver(policy=policy)
        for i in range(5):
            d.route(f"r{i}", hashes(i % 2, 2))
        return d.router.digest

    assert run("affinity") == run("affinity")
    assert run("affinity") != run("round-robin")


def test_a_router_restored_from_its_snapshot_decides_as_the_original() -> None:
    a = Driver()
    for i in range(5):
        a.route(f"r{i}", hashes(i % 3, 2))
    a.report(1, waiting=3, free=7)
    b = Driver()
    b.router = Router.from_snapshot(a.router.snapshot())
    assert b.router.snapshot() == a.router.snapshot()
    for i in range(5, 12):
        assert a.route(f"r{i}", hashes(i % 4, 2)) == b.route(f"r{i}", hashes(i % 4, 2))
    assert a.router.digest == b.router.digest


def test_ticks_must_come_in_order() -> None:
    router = Router(RouterConfig(replicas=1))
    with pytest.raises(ValueError, match="router tick 1 after tick -1"):
        router.tick(RouterTickInputs(1, 0, []))


@pytest.mark.parametrize("breakage", ["open-on-dead", "negative", "cache", "turn"])
def test_check_invariants_names_each_broken_rule(breakage: str) -> None:
    d = Driver(cache_blocks=2)
    d.route("a", hashes(1, 2))
    if breakage == "open-on-dead":
        d.router.replicas[0].live = False
        match = "which is down"
    elif breakage == "negative":
        d.router.replicas[1].waiting = -1
        match = "negative"
    elif breakage == "cache":
        d.router.replicas[0].cached[b"x" * 16] = None
        match = "over cache_blocks"
    else:
        d.router.turn = 3
        match = "round-robin turn"
    with pytest.raises(RouterInvariantError, match=match):
        d.router.check_invariants()


def test_the_configuration_is_checked_at_one_boundary() -> None:
    with pytest.raises(ValueError, match=r"replicas"):
        RouterConfig.checked({"replicas": 0})
    with pytest.raises(ValueError, match=r"policy"):
        RouterConfig.checked({"replicas": 2, "policy": "random"})
    with pytest.raises(ValueError, match=r"load_slack"):
        RouterConfig.checked(b'{"replicas": 2, "load_slack": -1}')
