"""The core level's schedule: every question the simulator asks (``replay.policy``) answered by a strategy.

The answers come from ``random.Random`` seeded by (seed, strategy, faults). Moving a completion is legal by
construction: the simulator schedules it only after its cause, and the device's results keep their FIFO order (a
step result is moved by stalling the device: ``device_steps`` 0). Strategies: ``random`` (uniform delays, 0-2 device
steps per tick, shuffled inputs), ``pct`` (1-3 change points among the first completions: those are delayed a lot,
the rest prompt), ``delay`` (at most 1-3 completions delayed per run). ``faults`` adds failed steps, failed spills
and swap-ins, and slow I/O (long spill and swap-in delays). Once the script's last action has passed, the run sets
``healed``: the faults heal and every answer is prompt.

Each answer that differs from the prompt default (``default_policy``) is a moved event (``ExplorePolicy.deviated``
notes which), the unit the driver shrinks.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from tickloom.engine.core import CoreConfig
from tickloom.events import DeadlineReached, Input
from tickloom.replay.policy import Completion, Kind, Policy
from tickloom.tools.explore.driver import STRATEGIES

EARLY_NS = 3_000_000
"""How far the deadline actor's clock may lead the core's: a report up to this early is legal."""


def default_policy(config: CoreConfig) -> Policy:
    """The prompt default: one step per tick after a tick in the device's queue at depth 2 (two steps in flight),
    spills answered once the device has run the copy, deadlines reported when due, everything in the next tick."""
    return Policy(device_lag=1 if config.pipeline_depth > 1 else 0, spill_after_device=True, report_deadlines=True,
                  spill_block_bytes=4096)


@dataclasses.dataclass(slots=True)
class ExplorePolicy(Policy):
    """A strategy's answers (see the module docstring); ``deviated`` notes, per answer, whether it differs from the
    default's (``Policy``'s answer to the same question), in the order the simulator records its decisions."""

    rng: random.Random = dataclasses.field(default_factory=random.Random)
    strategy: str = "random"
    faults: bool = False
    healed: bool = False
    deviated: list[bool] = dataclasses.field(default_factory=list)
    points: frozenset[int] = frozenset()
    budget: int = 0
    asked: int = 0
    stall_until: int = -1

    def __post_init__(self) -> None:
        if self.strategy == "pct":
            self.points = frozenset(self.rng.sample(range(160), self.rng.randint(1, 3)))
        elif self.strategy == "delay":
            self.budget = self.rng.randint(1, 3)

    def _note(self, value: object, default: object) -> None:
        self.deviated.append(value != default)

    def _moved(self, rate: float = 0.02) -> int:
        """How late the strategy moves the completion asked about (0: prompt); ``rate``: the chance, under
        ``delay``, that it spends one of its moves here (more for a completion than for one tick of the device)."""
        if self.healed:
            return 0
        n = self.asked
        self.asked += 1
        rng = self.rng
        if self.strategy == "random":
            return rng.choice((0, 0, 0, 0, 1, 2, 3, 6))
        if self.strategy == "pct":
            return rng.randint(8, 30) if n in self.points else 0
        if self.budget and rng.random() < rate:
            self.budget -= 1
            return rng.randint(1, 10)
        return 0

    def device_steps(self, tick: int) -> int:
        default = self.steps_per_tick
        if self.healed:
            value = default
        elif self.strategy == "random":
            value = self.rng.choice((0, 1, 1, 1, 2))
        elif tick < self.stall_until:
            value = 0
        else:
            stall = self._moved()
            self.stall_until = tick + stall
            value = 0 if stall else default
        self._note(value, default)
        return value

    def step_fails(self, step_id: int) -> bool:
        value = self.faults and not self.healed and self.rng.random() < 0.02
        self._note(value, False)
        return value

    def spill_ok(self, command: object) -> bool:
        value = not (self.faults and not self.healed and self.rng.random() < 0.15)
        self._note(value, True)
        return value

    def swap_in(self, command: object) -> bool | None:
        value = not (self.faults and not self.healed and self.rng.random() < 0.05)
        self._note(value, True)
        return value

    def delay(self, completion: Completion) -> int:
        value = self._moved(0.25)
        slow_io = self.faults and not self.healed and completion.kind in (Kind.SPILL, Kind.SWAP_IN)
        if slow_io and self.rng.random() < 0.1:
            value += self.rng.randint(10, 40)
        self._note(value, 0)
        return value

    def deadline_due(self, request_id: str, deadline_ns: int, now_ns: int) -> bool:
        default = now_ns >= deadline_ns
        value = default
        if default or deadline_ns - now_ns <= EARLY_NS:
            value = default != bool(self._moved())  # reported late, or early (the actor's clock leads)
        self._note(value, default)
        return value

    def arrange(self, inputs: Sequence[Input], fired: Sequence[DeadlineReached]) -> tuple[int, ...]:
        default = Policy.arrange(self, inputs, fired)
        value = default
        if self.strategy == "random" and not self.healed:
            order = list(default)
            self.rng.shuffle(order)
            value = tuple(order)
        self._note(value, default)
        return value

    def merge(self, device: Sequence[Completion], due: Sequence[Completion]) -> tuple[int, ...]:
        default = Policy.merge(self, device, due)
        value = default
        if self.strategy == "random" and not self.healed and due:
            order = list(range(len(device)))  # the device's results keep their order
            for i in range(len(device), len(device) + len(due)):
                order.insert(self.rng.randint(0, len(order)), i)
            value = tuple(order)
        self._note(value, default)
        return value


def strategy_policy(seed: int, strategy: str, faults: bool, config: CoreConfig) -> ExplorePolicy:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    base = default_policy(config)
    return ExplorePolicy(device_lag=base.device_lag, spill_after_device=True, report_deadlines=True,
                         spill_block_bytes=base.spill_block_bytes, strategy=strategy, faults=faults,
                         rng=random.Random(f"schedule:{seed}:{strategy}:{faults}"))
