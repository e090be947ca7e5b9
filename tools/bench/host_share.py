"""How much of a CPU a thread got, from Linux's per-thread scheduler statistics.

``/proc/self/task/<tid>/schedstat`` holds three numbers: the nanoseconds the thread ran, the nanoseconds it was
runnable but waited for a CPU, and its time slices. On a shared machine a step's wall time is its running time plus
its waiting, so (running + waiting) / running is how much slower the host made the thread than a CPU of its own
would have: its *slowdown* (1.0 on an idle machine; on this project's 2 shared cores, with other sessions' tests
running, 1.3-2.1 for a whole engine run). The waiting is the host's, not the model's: ``whatif --validate`` sets
the slowdown of each real run's device thread against the baseline's, and ``bench calibrate`` takes each step's own
wait out of its time.

Where the statistics cannot be read (not Linux, no ``/proc``), every figure is None and nothing is corrected.
"""

from __future__ import annotations

import os

INTERVAL_S = 0.05
"""How often ``Slowdown`` samples the threads while a run goes on."""


def _read(path: str) -> tuple[int, int] | None:
    try:
        with open(path, encoding="ascii") as f:
            running, waiting, _ = f.read().split()
        return int(running), int(waiting)
    except (OSError, ValueError):  # the thread ended, or no schedstat here: that thread's figures are unknown
        return None


def thread_stats() -> dict[int, tuple[int, int]]:
    """Every thread of this process: tid -> (ns running, ns waiting for a CPU); {} where they cannot be read."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    out = {}
    for tid in tids:
        stats = _read(f"/proc/self/task/{tid}/schedstat")
        if stats is not None and tid.isdigit():
            out[int(tid)] = stats
    return out


def waited_ns() -> int | None:
    """The calling thread's ns waiting for a CPU so far (None where unknown)."""
    stats = _read("/proc/thread-self/schedstat")
    return None if stats is None else stats[1]


class Slowdown:
    """The slowdown of the busiest thread over a run: made at the run's start, ``sample`` called every
    ``INTERVAL_S`` while it goes on and once at its end (a thread that ends before the end still counts up to
    its last sample); the busiest thread (the most running since the start) is an engine run's device thread."""

    def __init__(self) -> None:
        self.first = thread_stats()
        self.last = dict(self.first)

    def sample(self) -> None:
        self.last.update(thread_stats())

    def busiest(self) -> tuple[int, int] | None:
        """(ns running, ns waiting) since the start of the thread that ran the most; None if none ran."""
        deltas = [(running - self.first.get(tid, (0, 0))[0], waiting - self.first.get(tid, (0, 0))[1])
                  for tid, (running, waiting) in self.last.items()]
        top = max(deltas, default=None)
        return top if top is not None and top[0] > 0 else None

    @property
    def value(self) -> float | None:
        """(running + waiting) / running of the busiest thread; None where unknown."""
        top = self.busiest()
        return None if top is None else (top[0] + top[1]) / top[0]
