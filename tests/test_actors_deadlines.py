"""The deadline actor: watch, unwatch, re-watch and expiry in any order, alone and inside the engine."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio
import trio.testing
from engine_helpers import assert_replays, core_finishes, stub_config

from tickloom import Engine, SamplingParams
from tickloom.actors.deadlines import DeadlineActor
from tickloom.actors.mailbox import Envelope, Outbox, Source
from tickloom.events import DeadlineReached, UnwatchDeadline, WatchDeadline


async def test_a_request_that_finishes_before_its_deadline_does_not_crash_the_engine(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The regression: the timer slept for req-0, req-0 finished and was unwatched, the timer woke: KeyError."""
    log = tmp_path / "x.tlog"
    async with Engine.open(stub_config(log)) as engine:
        first = await engine.complete("hello", SamplingParams(max_tokens=3), deadline=0.5)
        await trio.sleep(1.0)
        second = await engine.complete("hello again", SamplingParams(max_tokens=3))
        assert engine.runtime.deadlines.watched == 0
    assert first.finish_reason == "length" and second.finish_reason == "length"
    assert {r: f.reason for r, f in core_finishes(log).items()} == {first.request_id: "length",
                                                                     second.request_id: "length"}
    assert_replays(log)


def _actor(limit: int = 64) -> tuple[DeadlineActor, trio.MemoryReceiveChannel[Envelope]]:
    send, receive = trio.open_memory_channel[Envelope](limit)
    return DeadlineActor(Outbox(Source.DEADLINE, send), limit), receive


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


async def _collect(receive: trio.MemoryReceiveChannel[Envelope], into: list[tuple[float, DeadlineReached]]) -> None:
    async for envelope in receive:
        assert isinstance(envelope.msg, DeadlineReached)
        into.append((trio.current_time(), envelope.msg))


async def test_expiry_reports_once_at_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    actor, receive = _actor()
    seen: list[tuple[float, DeadlineReached]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        nursery.start_soon(_collect, receive, seen)
        actor.submit_nowait(WatchDeadline("a", _ns(2.0)))
        actor.submit_nowait(WatchDeadline("b", _ns(1.0)))
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert [(t, m.request_id, m.deadline_ns) for t, m in seen] == [(1.0, "b", _ns(1.0)), (2.0, "a", _ns(2.0))]
    assert actor.watched == 0


async def test_unwatch_while_the_timer_sleeps_reports_nothing(autojump_clock: trio.testing.MockClock) -> None:
    actor, receive = _actor()
    seen: list[tuple[float, DeadlineReached]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        nursery.start_soon(_collect, receive, seen)
        actor.submit_nowait(WatchDeadline("a", _ns(1.0)))
        await trio.sleep(0.5)  # the timer is now asleep until 1.0, for "a"
        actor.submit_nowait(UnwatchDeadline("a"))
        await trio.sleep(2)
        nursery.cancel_scope.cancel()
    assert seen == []


async def test_rewatch_moves_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    """Re-watching replaces the old deadline, whether it moves earlier or later."""
    actor, receive = _actor()
    seen: list[tuple[float, DeadlineReached]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        nursery.start_soon(_collect, receive, seen)
        actor.submit_nowait(WatchDeadline("later", _ns(1.0)))
        actor.submit_nowait(WatchDeadline("sooner", _ns(3.0)))
        await trio.sleep(0.5)
        actor.submit_nowait(WatchDeadline("later", _ns(2.0)))
        actor.submit_nowait(WatchDeadline("sooner", _ns(1.5)))
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert [(t, m.request_id) for t, m in seen] == [(1.5, "sooner"), (2.0, "later")]


async def test_the_watch_bound_counts_live_watches_only(autojump_clock: trio.testing.MockClock) -> None:
    actor, _ = _actor(limit=2)
    actor.submit_nowait(WatchDeadline("a", _ns(1.0)))
    actor.submit_nowait(WatchDeadline("a", _ns(2.0)))  # a re-watch takes no second place
    actor.submit_nowait(WatchDeadline("b", _ns(1.0)))
    actor.submit_nowait(UnwatchDeadline("b"))
    actor.submit_nowait(WatchDeadline("c", _ns(1.0)))
    assert actor.watched == 2


@pytest.mark.parametrize("seed", range(20))
async def test_random_orders_match_a_model(seed: int, autojump_clock: trio.testing.MockClock) -> None:
    """Random watch/unwatch/re-watch at random times: reports are exactly the model's, each at its time."""
    rng = random.Random(seed)
    actor, receive = _actor(limit=256)
    seen: list[tuple[float, DeadlineReached]] = []
    current: dict[str, int] = {}
    expected: list[tuple[int, str]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        nursery.start_soon(_collect, receive, seen)
        now_ms = 0
        for _ in range(200):
            step_ms = rng.choice([0, 0, 1, 3, 10, 25])
            await trio.sleep(step_ms / 1000)
            now_ms += step_ms
            for rid, due in sorted(current.items()):  # what the model says expired meanwhile
                if due <= _ns(now_ms / 1000):
                    expected.append((due, rid))
                    del current[rid]
            rid = f"r{rng.randrange(12)}"
            if rng.random() < 0.6:
                # Half-millisecond offsets: no deadline falls exactly on one of this loop's wake-ups, where
                # whether the timer or this loop runs first is (legitimately) unordered.
                due = _ns((now_ms + rng.randrange(1, 60) + 0.5) / 1000)
                actor.submit_nowait(WatchDeadline(rid, due))
                current[rid] = due
            else:
                actor.submit_nowait(UnwatchDeadline(rid))
                current.pop(rid, None)
        await trio.sleep(1)
        expected += sorted((due, rid) for rid, due in current.items())
        nursery.cancel_scope.cancel()
    assert sorted((m.deadline_ns, m.request_id) for _, m in seen) == sorted(expected)
    assert all(_ns(t) >= m.deadline_ns for t, m in seen), "never early"
    assert actor.watched == 0
