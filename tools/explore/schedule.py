"""A reproducible trio scheduler for the actor-level explorer: trio's own hook, seeded, with a choice of policies.

trio shuffles each batch of runnable tasks with its module-level ``trio._core._run._r``; when
``_ALLOW_DETERMINISTIC_SCHEDULING`` is set (the hook trio keeps for Hypothesis) it first sorts the batch by task
creation order, so the order becomes a pure function of ``_r``'s state. ``deterministic_trio`` sets the flag and
puts a seeded policy in ``_r`` for the runs inside it, and puts trio's own back after:

* ``random``: a seeded shuffle of every batch (trio's own behaviour under Hypothesis);
* ``pct``: probabilistic concurrency testing: random task priorities, a few priority change points;
* ``delay``: creation order, with a few tasks delayed to the end of their batch (delay-bounded scheduling).

The hook is private, so the package asks only for a range of trio and the extra ``tickloom[explore]`` pins the
release that has it. Importing this module (and so the actor level, ``tools.explore.actors``) checks for it and
raises ``ImportError``, saying which trio to install, when it is missing.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, MutableSequence
from contextlib import contextmanager
from typing import Any

import trio

from tickloom.tools.explore.driver import STRATEGIES

EXPLORE_TRIO = "trio==0.35.0"
"""The trio release the extra ``tickloom[explore]`` pins (pyproject.toml)."""


def trio_hook_present() -> bool:
    """Whether trio still has the deterministic-scheduling hook this explorer relies on."""
    run_mod = trio._core._run
    return hasattr(run_mod, "_ALLOW_DETERMINISTIC_SCHEDULING") and isinstance(getattr(run_mod, "_r", None),
                                                                                random.Random)


if not trio_hook_present():
    raise ImportError(f"the actor-level explorer seeds trio's scheduler through trio._core._run's private "
                      f"_ALLOW_DETERMINISTIC_SCHEDULING and _r, which trio {trio.__version__} lacks; it needs "
                      f"{EXPLORE_TRIO}: pip install 'tickloom[explore]'")


# -- the schedule --------------------------------------------------------------------------------------------------
class PCTPolicy(random.Random):
    """Probabilistic concurrency testing over trio's run batches: each task gets a random priority when first seen;
    a batch runs highest priority first; at ``depth`` random batch numbers the task about to run drops to the
    lowest priority."""

    def __init__(self, seed: int, depth: int = 3, horizon: int = 3000) -> None:
        super().__init__(seed)
        self._prio: dict[int, float] = {}
        self._changes = sorted(self.randrange(horizon) for _ in range(depth))
        self._batch = 0
        self._low = 0.0

    def shuffle(self, x: MutableSequence[Any]) -> None:
        prio = self._prio
        for task in x:
            if task._counter not in prio:
                prio[task._counter] = 1.0 + self.random()
        x[:] = sorted(x, key=lambda t: prio[t._counter])  # trio runs the batch from its end
        self._batch += 1
        while self._changes and self._batch >= self._changes[0]:
            self._changes.pop(0)
            if x:
                self._low -= 1.0
                prio[x[-1]._counter] = self._low
                x.insert(0, x.pop())


class DelayPolicy(random.Random):
    """Delay-bounded scheduling: tasks run in creation order, except that up to ``budget`` times a random task of
    a batch is delayed to the batch's end."""

    def __init__(self, seed: int, budget: int = 4, chance: float = 0.02) -> None:
        super().__init__(seed)
        self._budget = budget
        self._chance = chance

    def shuffle(self, x: MutableSequence[Any]) -> None:
        x.reverse()  # trio runs the batch from its end: lowest creation counter first
        if len(x) > 1 and self._budget and self.random() < self._chance:
            self._budget -= 1
            x.insert(0, x.pop(self.randrange(len(x))))


def schedule_policy(strategy: str, seed: int) -> random.Random:
    if strategy == "random":
        return random.Random(seed)
    if strategy == "pct":
        return PCTPolicy(seed)
    if strategy == "delay":
        return DelayPolicy(seed)
    raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")


@contextmanager
def deterministic_trio(seed: int, strategy: str) -> Iterator[None]:
    """Make trio's scheduler a pure function of ``seed`` and ``strategy`` for the runs inside the block."""
    run_mod = trio._core._run
    saved = (run_mod._ALLOW_DETERMINISTIC_SCHEDULING, run_mod._r)
    setattr(run_mod, "_ALLOW_DETERMINISTIC_SCHEDULING", True)  # noqa: B010 (Final in trio)
    run_mod._r = schedule_policy(strategy, seed)
    try:
        yield
    finally:
        setattr(run_mod, "_ALLOW_DETERMINISTIC_SCHEDULING", saved[0])  # noqa: B010
        run_mod._r = saved[1]
