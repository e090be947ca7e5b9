"""Behavioural tests that kill mutants of the step actor (scripts/mutate.sh --area actors) that its own tests leave
alive: dispatch, the log before the tokens, snapshots and fsync, the clock, the idle event, its statistics."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import tickloom.actors.step as step_module
from tickloom.actors.mailbox import Envelope, Source
from tickloom.actors.step import StepActor
from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.engine.core.snapshot import encode_snapshot
from tickloom.events import (
    Command,
    Preempted,
    RequestArrived,
    RunStep,
    SamplingSpec,
    Shutdown,
    SnapshotRecord,
    StepDone,
    TickInputs,
    TickOutputs,
)

# --- the step actor -------------------------------------------------------------------------------------------------


CORE = CoreConfig(num_blocks=24, block_size=8, max_batch_size=6, max_seq_len=96, max_prefill_tokens=32,
                  max_batch_tokens=48, pipeline_depth=2, spill_enabled=True, preempt_immunity_tokens=2,
                  eos_token_ids=(1,), vocab_size=400)


class _Journal:
    """Every actor's side of the step actor, writing what it is handed into one list, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[object, ...]] = []
        self.steps: list[RunStep] = []
        self.writer = self
        self.outputs: list[TickOutputs] = []
        self.snapshots: list[SnapshotRecord] = []

    # the device, deadline, spill and swap-in actors
    def submit_nowait(self, command: Command) -> None:
        if isinstance(command, RunStep):
            self.steps.append(command)
        self.events.append(("submit", type(command).__name__))

    # the retire actor
    def deliver_nowait(self, commands: list[Command]) -> None:
        self.events.append(("deliver", *[type(c).__name__ for c in commands]))

    # the log actor and its writer
    def append_tick(self, inputs: TickInputs, outputs: TickOutputs, encoded: bytes | None = None) -> int:
        self.outputs.append(outputs)
        self.events.append(("tick", inputs.tick, inputs.now_ns, *[type(i).__name__ for i in inputs.inputs]))
        return 100

    def append_snapshot(self, snapshot: SnapshotRecord) -> int:
        self.snapshots.append(snapshot)
        self.events.append(("snapshot", snapshot.tick))
        return 7

    async def sync(self) -> None:
        self.events.append(("sync",))

    def flush(self) -> None:
        self.events.append(("flush",))

    def flush_if_large(self) -> None:
        self.events.append(("flush_if_large",))


class _Clock:
    """A thread CPU clock that advances 1000 ns per reading."""

    def __init__(self) -> None:
        self.now = 0

    def thread_time_ns(self) -> int:
        self.now += 1000
        return self.now


def _actor(journal: _Journal, *, log: bool = True, **kw: object) -> StepActor:
    _send, receive = trio.open_memory_channel[Envelope](8)
    return StepActor(SchedulerCore(CORE), receive, device=journal, deadlines=journal, retire=journal,  # type: ignore[arg-type]
                     spill=journal, swap_in=journal, log=journal if log else None, **kw)  # type: ignore[arg-type]


def _arrival(rid: str, max_tokens: int = 2) -> RequestArrived:
    return RequestArrived(rid, [5, 6, 7], SamplingSpec(max_tokens=max_tokens), seed=3)


async def test_each_tick_is_logged_before_its_tokens_reach_a_client(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(step_module, "time", clock)
    j = _Journal()
    now = iter(range(1000, 10**6, 1000))
    actor = _actor(j, clock_ns=lambda: next(now))
    assert await actor.run_tick([_arrival("r")]) is True, "run ahead: the pipeline has room for a second step"
    assert await actor.run_tick([]) is False
    [s0, s1] = j.steps
    await actor.run_tick([StepDone(s0.step_id, ["r"], [9])])
    await actor.run_tick([StepDone(s1.step_id, ["r"], [10])])
    ticks = [e for e in j.events if e[0] == "tick"]
    assert ticks == [("tick", 0, 1000, "RequestArrived"), ("tick", 1, 2000), ("tick", 2, 3000, "StepDone"),
                     ("tick", 3, 4000, "StepDone")]
    assert actor.tick == 4 and actor.stats.ticks == 4
    # ticks 0 and 1: nothing for a client, the log's own flush policy; ticks 2 and 3: written out first
    before_tokens = j.events[:j.events.index(ticks[2])]
    assert before_tokens.count(("flush_if_large",)) == 2 and ("flush",) not in before_tokens
    for tick in (ticks[2], ticks[3]):
        rest = j.events[j.events.index(tick) + 1:]
        deliver = next(i for i, e in enumerate(rest) if e[0] == "deliver")
        assert rest[deliver - 1] == ("flush",), "the frame is handed to the OS just before the delivery"
        assert all(e[0] == "submit" for e in rest[:deliver - 1]), "the other commands left first"
    assert [e for e in j.events if e[0] == "deliver"] == [("deliver", "EmitTokens"),
                                                            ("deliver", "EmitTokens", "Finish")]
    assert ("flush_if_large",) not in j.events[j.events.index(ticks[2]):]
    stats = actor.stats
    assert (stats.steps, stats.rows, stats.tokens) == (2, 2, 2)
    assert stats.log_bytes == 400 and stats.log_ns == 1000 * (4 + 2), "4 appends and 2 flushes for clients"
    assert (stats.preemptions, stats.swaps) == (0, 0)
    assert ("sync",) not in j.events and ("snapshot", 1) not in j.events


async def test_a_snapshot_every_n_ticks_and_an_fsync_each_tick_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_module, "time", _Clock())
    j = _Journal()
    actor = _actor(j, fsync="tick", snapshot_every=2)
    await actor.run_tick([_arrival("r", 6)])
    assert j.snapshots == []
    await actor.run_tick([])
    [snapshot] = j.snapshots
    assert snapshot.tick == 1 and snapshot.digest == j.outputs[1].digest
    assert snapshot.state == encode_snapshot(actor.core.snapshot())
    await actor.run_tick([])
    await actor.run_tick([])
    assert [s.tick for s in j.snapshots] == [1, 3]
    assert [e[0] for e in j.events if e[0] in ("tick", "snapshot", "sync")] == [
        "tick", "sync", "tick", "snapshot", "sync", "tick", "sync", "tick", "snapshot", "sync"]
    assert actor.stats.log_bytes == 4 * 100 + 2 * 7 and actor.stats.log_ns == 4 * 1000


async def test_without_a_log_nothing_is_flushed_and_ticks_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_module, "time", _Clock())
    j = _Journal()
    actor = _actor(j, log=False, fsync="tick", snapshot_every=1)
    await actor.run_tick([_arrival("r", 1)])
    [step] = j.steps
    await actor.run_tick([StepDone(step.step_id, ["r"], [9])])
    assert [e for e in j.events if e[0] not in ("submit", "deliver")] == []
    assert ("deliver", "EmitTokens", "Finish") in j.events
    assert actor.stats.log_ns == 0 and actor.stats.log_bytes == 0 and actor.stats.ticks == 2


async def test_the_default_clock_is_trio_time_in_nanoseconds(autojump_clock: trio.testing.MockClock) -> None:
    j = _Journal()
    actor = _actor(j)
    await trio.sleep(2.5)
    await actor.run_tick([])
    assert j.events[0] == ("tick", 0, int(trio.current_time() * 1e9)) and trio.current_time() >= 2.5


async def test_idle_is_set_exactly_while_no_request_is_live() -> None:
    j = _Journal()
    actor = _actor(j)
    assert not actor.idle.is_set()
    await actor.run_tick([])
    first = actor.idle
    assert first.is_set()
    await actor.run_tick([_arrival("r", 1)])
    assert first.is_set() and not actor.idle.is_set(), "a fresh event: the old one's waiters were woken"
    busy = actor.idle
    await actor.run_tick([])
    assert actor.idle is busy and not busy.is_set()
    await actor.run_tick([StepDone(j.steps[0].step_id, ["r"], [9])])
    assert actor.idle is busy and busy.is_set()


async def test_the_run_loop_sorts_a_batch_ticks_again_when_asked_and_reports_shutdown(
        autojump_clock: trio.testing.MockClock) -> None:
    j = _Journal()
    send, receive = trio.open_memory_channel[Envelope](8)
    actor = StepActor(SchedulerCore(CORE), receive, device=j, deadlines=j, retire=j, spill=j, swap_in=j,  # type: ignore[arg-type]
                      log=j)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        await trio.testing.wait_all_tasks_blocked()
        assert j.events == [], "no input, no tick"
        send.send_nowait(Envelope(int(Source.RETIRE), 1, _arrival("late")))
        send.send_nowait(Envelope(int(Source.CLIENT), 2, _arrival("b")))
        send.send_nowait(Envelope(int(Source.CLIENT), 1, _arrival("a")))
        await trio.testing.wait_all_tasks_blocked()
        ticks = [e for e in j.events if e[0] == "tick"]
        assert [t[3:] for t in ticks] == [("RequestArrived",) * 3, ()], "one batch, then a tick of its own"
        assert [o.commands[0].request_id for o in j.outputs[:1]] == ["a"]  # type: ignore[attr-defined]
        assert not actor.shut_down.is_set()
        send.send_nowait(Envelope(int(Source.CLIENT), 3, Shutdown()))
        await trio.testing.wait_all_tasks_blocked()
        assert actor.shut_down.is_set()
        nursery.cancel_scope.cancel()


async def test_preemptions_and_swaps_are_counted() -> None:
    j = _Journal()
    actor = _actor(j)
    actor.dispatch([Preempted("a", "swap"), Preempted("b", "recompute"), Preempted("c", "swap")])
    assert (actor.stats.preemptions, actor.stats.swaps) == (3, 2)
