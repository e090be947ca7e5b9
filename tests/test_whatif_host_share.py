"""``tools/bench/host_share.py``: a thread's running and waiting time from Linux's scheduler statistics, and the
slowdown ``whatif --validate`` scales its prediction by."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from tickloom.tools.bench import host_share
from tickloom.tools.bench.host_share import Slowdown, thread_stats, waited_ns

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/task"),
                           reason="per-thread scheduler statistics are Linux's")


def _spin(n: int) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


@linux
def test_the_busiest_thread_is_the_one_that_ran() -> None:
    """A worker that spins while the main thread waits for it: the slowdown's busiest thread is the worker (it
    ran more than the waiting main thread), its running time counts though it ended before the last sample, and
    a slowdown is never below 1 (waiting is never negative)."""
    host = Slowdown()
    seen: list[int] = []

    def work() -> None:
        seen.append(threading.get_native_id())
        _spin(2_000_000)
        host.sample()  # its last sample, taken while it still runs

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    host.sample()  # the worker has ended (its /proc entry may linger a moment): its figures are kept
    assert seen[0] in host.last
    top = host.busiest()
    assert top is not None and top == (host.last[seen[0]][0] - host.first.get(seen[0], (0, 0))[0],
                                       host.last[seen[0]][1] - host.first.get(seen[0], (0, 0))[1])
    assert host.value is not None and host.value >= 1.0
    own = thread_stats()[threading.get_native_id()]
    wait = waited_ns()
    assert wait is not None and wait >= own[1]


def test_without_statistics_nothing_is_known(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(path: str) -> list[str]:
        raise FileNotFoundError(path)

    monkeypatch.setattr(host_share.os, "listdir", missing)
    monkeypatch.setattr(host_share, "_read", lambda path: None)
    host = Slowdown()
    host.sample()
    assert thread_stats() == {} and host.busiest() is None and host.value is None and waited_ns() is None
