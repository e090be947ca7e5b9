"""The simulator (``replay/sim.py``): one routing table, the simulated actors, and runs re-played from decisions."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest
import trio

from tickloom.actors.step import StepActor
from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.events import (
    COMMAND_TYPES,
    BindRequest,
    Command,
    DeadlineReached,
    DropSpill,
    EmitTokens,
    Finish,
    Input,
    Preempted,
    PrefetchSpill,
    ReleaseRequest,
    RequestArrived,
    RequestCancelled,
    RunStep,
    SamplingSpec,
    SpillDone,
    SpillOut,
    StepDone,
    SwapIn,
    UnwatchDeadline,
    Usage,
    WatchDeadline,
    encode,
)
from tickloom.events.routing import ROUTES, Actor, routed_to
from tickloom.replay.oracle import OracleExecutor
from tickloom.replay.policy import Decision, Kind, Policy, RandomPolicy
from tickloom.replay.sim import TICK_NS, Simulator

CONFIG = CoreConfig(num_blocks=24, block_size=8, max_batch_size=6, max_seq_len=96, max_prefill_tokens=32,
                    max_batch_tokens=48, pipeline_depth=2, spill_enabled=True, preempt_immunity_tokens=2,
                    eos_token_ids=(1,), vocab_size=400)


def test_every_command_type_has_a_route() -> None:
    assert set(ROUTES) == set(COMMAND_TYPES)
    assert all(ROUTES.values())
    assert ROUTES[SpillOut] == (Actor.DEVICE, Actor.SPILL), "the device copies first, then the store writes"
    assert ROUTES[Preempted] == (Actor.NONE,)
    device = {BindRequest, RunStep, SwapIn, ReleaseRequest, SpillOut, DropSpill}
    assert set(routed_to(Actor.DEVICE, Actor.SPILL)) == device, "what a device that keeps spilled copies runs"


class _Sink:
    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name, self.log = name, log

    def submit_nowait(self, command: Command) -> None:
        self.log.append((self.name, type(command).__name__))

    def deliver_nowait(self, commands: list[Command]) -> None:
        self.log += [(self.name, type(c).__name__) for c in commands]


def test_the_step_actor_dispatches_by_the_table() -> None:
    log: list[tuple[str, str]] = []
    _send, receive = trio.open_memory_channel[object](1)
    actor = StepActor(SchedulerCore(CONFIG), receive, device=_Sink("device", log),  # type: ignore[arg-type]
                      deadlines=_Sink("deadlines", log), retire=_Sink("retire", log), spill=_Sink("spill", log),
                      swap_in=_Sink("swap_in", log), log=None)
    usage = Usage(1, 0, 0)
    commands: list[Command] = [
        Finish("a", "stop", usage), SpillOut("b", [1], 8), Preempted("b", "swap"), DropSpill("c"),
        PrefetchSpill("d"), WatchDeadline("e", 5), UnwatchDeadline("e"), EmitTokens(["f"], [3], [0], [False]),
    ]
    actor.dispatch(commands)
    names = {"device": Actor.DEVICE, "spill": Actor.SPILL, "swap_in": Actor.SWAP_IN, "deadlines": Actor.DEADLINES,
             "retire": Actor.RETIRE}
    expected = [(name, type(c).__name__) for c in commands for actor_ in ROUTES[type(c)]
                for name, a in names.items() if a is actor_ and a is not Actor.RETIRE]
    expected += [("retire", "Finish"), ("retire", "EmitTokens")]  # held back to the end of the tick, in order
    assert log == expected
    assert actor.stats.preemptions == 1 and actor.stats.swaps == 1 and actor.stats.tokens == 1


def _script(seed: int) -> dict[int, list[RequestArrived | RequestCancelled]]:
    rng = random.Random(seed)
    script: dict[int, list[RequestArrived | RequestCancelled]] = {}
    for i in range(24):
        deadline = (i + rng.randint(4, 40)) * TICK_NS if rng.random() < 0.3 else None
        prompt = [rng.randrange(2, 400) for _ in range(rng.randint(1, 30))]
        script.setdefault(i, []).append(RequestArrived(f"r{i}", prompt, SamplingSpec(max_tokens=rng.randint(1, 40)),
                                                       seed=i, deadline_ns=deadline))
    script.setdefault(10, []).append(RequestCancelled("r3"))
    return script


def _run(policy: Policy, seed: int = 5, replay: Sequence[Decision] = ()) -> Simulator:
    sim = Simulator(SchedulerCore(CONFIG), OracleExecutor(CONFIG.vocab_size, avoid=(1,)), policy,
                    check_invariants=True, stop_at={"r6": 2}, replay=replay)
    script = _script(seed)
    for tick in range(30):
        sim.step(*script.get(tick, ()))
    sim.run(2000)
    return sim


def _random_policy(seed: int) -> RandomPolicy:
    return RandomPolicy(rng=random.Random(seed), fail_rate=0.02, fail_horizon=500, step_choices=(0, 1, 1, 2))


def _arrivals(sim: Simulator, kind: type) -> list[tuple[int, Input]]:
    return [(t.tick, i) for t in sim.inputs for i in t.inputs if isinstance(i, kind)]


def test_a_random_run_replays_from_its_decisions() -> None:
    first = _run(_random_policy(11))
    assert first.decisions, "every answer of the policy is recorded"
    assert {"device_steps", "spill_ok", "delay", "merge", "deadline_due", "arrange", "step_fails"} <= {
        d.what for d in first.decisions
    }
    # The fallback policy is never asked: every question is answered from the list.
    again = _run(first.policy.fixed(), replay=first.decisions)
    assert [encode(o) for o in again.outputs] == [encode(o) for o in first.outputs]
    assert [encode(i) for i in again.inputs] == [encode(i) for i in first.inputs]
    assert len(first.finishes) == 24 and first.finishes == again.finishes
    assert again.decisions == first.decisions


@pytest.mark.parametrize("seed", [12, 15, 16])
def test_a_moved_completion_is_delivered_where_the_edit_says_and_the_rest_stays(seed: int) -> None:
    """The explorer's hook: one completion's delay changed in the decision list; the run up to its cause is the
    same, it arrives that much later, and the run stays legal (invariants every tick, every request ends once)."""
    first = _run(_random_policy(seed))
    decisions = list(first.decisions or [])
    index = next(i for i, d in enumerate(decisions) if d.what == "delay" and d.key[0] == "spill")
    moved = decisions[index]
    assert isinstance(moved.value, int)
    decisions[index] = dataclasses.replace(moved, value=moved.value + 3)
    second = _run(first.policy.fixed(), replay=decisions)
    rid, n = moved.key[1], moved.key[2]
    before = [tick for tick, i in _arrivals(first, SpillDone) if isinstance(i, SpillDone) and i.request_id == rid]
    after = [tick for tick, i in _arrivals(second, SpillDone) if isinstance(i, SpillDone) and i.request_id == rid]
    assert isinstance(n, int) and after[n] == before[n] + 3
    cut = moved.tick + 1
    assert [encode(o) for o in second.outputs[:cut]] == [encode(o) for o in first.outputs[:cut]]
    assert len(second.finishes) == 24


def test_completions_never_precede_their_cause_and_the_device_keeps_fifo_order() -> None:
    policy = _random_policy(14)
    sim = Simulator(SchedulerCore(CONFIG), OracleExecutor(CONFIG.vocab_size, avoid=(1,)), policy)
    steps_seen: list[int] = []
    script = _script(14)
    for tick in range(200):
        sim.step(*script.get(tick, ()))
        assert all(c.due > c.caused_at for c in sim.schedule)
        steps_seen += [i.step_id for i in sim.pending if isinstance(i, StepDone)]
    assert steps_seen == sorted(steps_seen)


def test_deadlines_fire_when_due_and_honour_unwatch_and_rewatch() -> None:
    sim = Simulator(SchedulerCore(CONFIG), OracleExecutor(CONFIG.vocab_size), Policy(report_deadlines=True))
    sim.deadlines.watch("a", 3 * TICK_NS)
    sim.deadlines.watch("b", 2 * TICK_NS)
    sim.deadlines.watch("c", 1 * TICK_NS)
    sim.deadlines.unwatch("c")
    sim.deadlines.watch("a", 2 * TICK_NS)  # re-watched earlier
    sim.step()
    sim.step()
    out = sim.step()
    assert sim.inputs[2].inputs == [DeadlineReached("a", 2 * TICK_NS), DeadlineReached("b", 2 * TICK_NS)]
    assert not sim.deadlines.watched and out.tick == 2
    never = Simulator(SchedulerCore(CONFIG), OracleExecutor(CONFIG.vocab_size), Policy())
    never.deadlines.watch("a", 0)
    never.step()
    assert never.inputs[0].inputs == [] and never.deadlines.watched == {"a": 0}


def test_the_spill_store_waits_for_the_device_when_told() -> None:
    """With ``spill_after_device`` the ``SpillDone`` follows the device's run of the ``SpillOut`` (``device_lag``
    ticks later); without it, it comes in the next tick."""
    for after, lag, gap in ((True, 2, 3), (False, 2, 1), (True, 0, 1)):
        sim = Simulator(SchedulerCore(CONFIG), OracleExecutor(CONFIG.vocab_size), Policy(
            device_lag=lag, spill_after_device=after, spill_fails=frozenset({"x"})))
        sim._dispatch([SpillOut("x", [1, 2], 16)])
        spilled_at = sim.tick
        for _ in range(4):
            sim.step()
        arrived = [t.tick for t in sim.inputs for i in t.inputs if isinstance(i, SpillDone)]
        assert arrived == [spilled_at + gap], (after, lag, arrived)
        assert sim.inputs[arrived[0]].inputs == [SpillDone("x", False, "disk full", 0)]


def test_a_negative_delay_is_refused() -> None:
    class Early(Policy):
        def delay(self, completion):  # type: ignore[no-untyped-def]
            return -1

    sim = Simulator(SchedulerCore(CONFIG), OracleExecutor(CONFIG.vocab_size), Early())
    with pytest.raises(ValueError, match="never precedes its cause"):
        sim.send(RequestCancelled("x"))


def test_send_schedules_a_client_input_through_the_policy() -> None:
    class Late(Policy):
        def delay(self, completion):  # type: ignore[no-untyped-def]
            return 2 if completion.kind is Kind.CLIENT else 0

    sim = Simulator(SchedulerCore(CONFIG), OracleExecutor(CONFIG.vocab_size), Late())
    sim.send(RequestCancelled("nobody"))
    while sim.busy:
        sim.step()
    assert [t.tick for t in sim.inputs if t.inputs] == [3]
