"""Policies for the simulator (``replay/sim.py``): every timing, ordering and fault decision it does not make itself.

The simulator asks its policy, and only its policy, whenever the actors around the core could behave in more than
one legal way:

- ``device_steps``: how many ``RunStep``\\ s the device completes this tick (its FIFO keeps them in order), after
  ``device_lag`` ticks in the queue;
- ``step_fails`` / ``spill_ok`` / ``swap_in``: faults (a failed step, a failed spill, a failed or never answered
  prefetch);
- ``delay``: in how many ticks an asynchronous completion (a spill's or prefetch's answer, a stop report, a client
  input sent through the simulator) is delivered. The simulator keeps the schedule, so moving a completion to
  another legal tick is one number;
- ``deadline_due``: whether the deadline actor reports a watched deadline now (early, on time, late or never);
- ``arrange`` / ``merge``: the order of a tick's inputs.

``Policy`` is the fixed policy of the scripted drivers (the core tests' ``Harness``, ``record_core_run``, ``bench
core``), ``RandomPolicy`` the random one of the C26 blast. The simulator records every answer as a ``Decision``
keyed by what it is about (``Simulator.decisions``), and a simulator given such a list (``replay=``) takes its answers
from it, asking its policy only about what the list does not cover. So any run, however random, re-plays from its
decisions alone, and an edited list (one completion's delay changed) re-plays as that edit: the hook a race explorer
needs to move one completion to another tick and keep everything else.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Sequence

from tickloom.events import DeadlineReached, Input, PrefetchSpill, SpillOut

MS = 1_000_000


class Kind(enum.Enum):
    """What a completion is: who produced it."""

    DEVICE = "device"
    SPILL = "spill"
    SWAP_IN = "swap_in"
    STOP = "stop"
    CLIENT = "client"


@dataclasses.dataclass(slots=True)
class Completion:
    """An input an actor produced, on its way to the core."""

    input: Input
    kind: Kind
    caused_at: int
    """The tick of the command (or client action) that caused it: it is never delivered before ``caused_at + 1``."""
    seq: int
    """Production order over the whole run: the order in which a real engine's inbox would have received them."""
    due: int = 0
    """The tick whose inputs it joins."""
    key: Key = ()
    """Its identity (see ``Key``): how a recorded decision about it is found again."""


Key = tuple[str | int, ...]
"""A stable identity: of a completion (``("spill", request, n)`` for the n-th spill of a request, ``("step",
step_id)`` for a device result, ...), of a client input, or of a question (``(tick,)``, ``(step_id,)``)."""

Value = int | bool | tuple[Key, ...] | None
"""A count, a yes or no, "no answer", or an order (the identities of the ordered items)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """One answer: at ``tick``, ``what`` was asked about ``key`` and ``value`` answered (an order is recorded as
    the identities of the items in their chosen order, so that it still applies when other items come and go)."""

    tick: int
    what: str
    key: Key
    value: Value


@dataclasses.dataclass(slots=True)
class Policy:
    """Fixed timings: the scripted drivers' policy. Every completion is delivered in the next tick."""

    device_lag: int = 0
    """Ticks a command waits in the device's queue before it may run: 1 keeps two steps in flight at depth 2."""
    steps_per_tick: int = 1
    """``RunStep``\\ s the device completes per tick."""
    spill_after_device: bool = False
    """Whether the spill store answers only once the device has run the ``SpillOut`` (as the engine does), or at
    once when the command is dispatched (the core tests' older convention, kept for their pinned bytes)."""
    spill_fails: frozenset[str] = frozenset()
    """Requests whose spills fail (``SpillDone(ok=False)``)."""
    fail_steps: frozenset[int] = frozenset()
    """Steps the device reports as failed (``StepFailed``)."""
    swap_in_ready: bool = True
    """Whether the swap-in prefetcher answers ``PrefetchSpill`` at all (tests may send ``SwapInReady`` themselves)."""
    report_deadlines: bool = False
    """Whether the deadline actor reports ``DeadlineReached`` once ``now_ns`` reaches a watched deadline (without it,
    only the core's own sweep times requests out)."""
    spill_block_bytes: int = 0
    """``SpillDone.nbytes`` per spilled block."""

    def fixed(self) -> Policy:
        """A fixed policy with this one's structure (lag, when spills answer, spill sizes): the fallback for a run
        re-played from decisions, asked only what the decisions do not cover."""
        return Policy(device_lag=self.device_lag, steps_per_tick=self.steps_per_tick,
                      spill_after_device=self.spill_after_device, swap_in_ready=self.swap_in_ready,
                      report_deadlines=self.report_deadlines, spill_block_bytes=self.spill_block_bytes)

    def device_steps(self, tick: int) -> int:
        return self.steps_per_tick

    def step_fails(self, step_id: int) -> bool:
        return step_id in self.fail_steps

    def spill_ok(self, command: SpillOut) -> bool:
        return command.request_id not in self.spill_fails

    def swap_in(self, command: PrefetchSpill) -> bool | None:
        """True: ``SwapInReady``; False: ``SwapInFailed``; None: no answer."""
        return True if self.swap_in_ready else None

    def delay(self, completion: Completion) -> int:
        return 0

    def deadline_due(self, request_id: str, deadline_ns: int, now_ns: int) -> bool:
        return self.report_deadlines and now_ns >= deadline_ns

    def arrange(self, inputs: Sequence[Input], fired: Sequence[DeadlineReached]) -> tuple[int, ...]:
        """The order of a tick's new inputs, as indices into ``[*inputs, *fired]``: here the deadline reports first,
        by (deadline, request), then the clients' inputs."""
        n = len(inputs)
        order = sorted(range(len(fired)), key=lambda i: (fired[i].deadline_ns, fired[i].request_id))
        return (*(n + i for i in order), *range(n))

    def merge(self, device: Sequence[Completion], due: Sequence[Completion]) -> tuple[int, ...]:
        """The order of the completions delivered in the next tick, as indices into ``[*device, *due]``: here
        production order, so answers sent while the commands were dispatched come before the device's results."""
        both = [*device, *due]
        return tuple(sorted(range(len(both)), key=lambda i: both[i].seq))


@dataclasses.dataclass(slots=True)
class RandomPolicy(Policy):
    """Every actor at random, from one seeded ``random.Random`` (the C26 blast's actors; see ``tests/test_core_blast``).

    The device completes ``step_choices`` steps per tick and fails each step with ``fail_rate``; spills fail with
    ``spill_fail_rate`` and answer after ``spill_delays`` ticks; prefetches fail with ``swap_in_fail_rate`` and answer
    after ``swap_in_delays``; the deadline actor's clock leads the core's by ``deadline_early`` ms and reports with
    ``deadline_rate`` per tick; a tick's inputs are shuffled and late answers land anywhere among the device's
    results, which keep their order. ``draining`` turns the delays off and runs ``steps_per_tick`` steps per tick.
    The order of ``rng`` calls is part of the behaviour (recorded runs and golden digests depend on it).
    """

    rng: random.Random = dataclasses.field(default_factory=random.Random)
    fail_rate: float = 0.0
    fail_horizon: int = 200_000
    """``fail_steps`` is drawn once, up front, for step ids below this."""
    step_choices: tuple[int, ...] = (0, 1, 1, 1, 1)
    spill_fail_rate: float = 0.15
    spill_delays: tuple[int, ...] = (0, 0, 1, 2, 5)
    swap_in_fail_rate: float = 0.03
    swap_in_delays: tuple[int, ...] = (0, 0, 1, 3, 8)
    deadline_early: tuple[int, ...] = (0, 0, 0, 1, 2)
    deadline_rate: float = 0.7
    spill_block_bytes: int = 4096
    draining: bool = False

    def __post_init__(self) -> None:
        if self.fail_rate:
            rng = self.rng
            self.fail_steps = frozenset(i for i in range(self.fail_horizon) if rng.random() < self.fail_rate)

    def device_steps(self, tick: int) -> int:
        return self.steps_per_tick if self.draining else self.rng.choice(self.step_choices)

    def spill_ok(self, command: SpillOut) -> bool:
        return self.rng.random() >= self.spill_fail_rate

    def swap_in(self, command: PrefetchSpill) -> bool | None:
        return self.rng.random() >= self.swap_in_fail_rate

    def delay(self, completion: Completion) -> int:
        if self.draining:
            return 0
        if completion.kind is Kind.SPILL:
            return self.rng.choice(self.spill_delays)
        if completion.kind is Kind.SWAP_IN:
            return self.rng.choice(self.swap_in_delays)
        return 0

    def deadline_due(self, request_id: str, deadline_ns: int, now_ns: int) -> bool:
        early = self.rng.choice(self.deadline_early) * MS
        return now_ns + early >= deadline_ns and self.rng.random() < self.deadline_rate

    def arrange(self, inputs: Sequence[Input], fired: Sequence[DeadlineReached]) -> tuple[int, ...]:
        order = list(range(len(inputs) + len(fired)))
        self.rng.shuffle(order)
        return tuple(order)

    def merge(self, device: Sequence[Completion], due: Sequence[Completion]) -> tuple[int, ...]:
        # Any interleaving of the late answers with the device's results, which keep their order, is legal.
        order = list(range(len(device)))
        for i in range(len(device), len(device) + len(due)):
            order.insert(self.rng.randint(0, len(order)), i)
        return tuple(order)
