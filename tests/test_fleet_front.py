"""The fleet front end's closing, without a Ray cluster: the load watcher stops even when its cancel is swallowed.

On Python < 3.12, ``asyncio.wait_for`` returns the awaited call's result instead of raising ``CancelledError`` when
the cancel lands in the same loop iteration as the call completes. The watcher polls each replica's load through
``wait_for``, so a fleet closing at that moment waited for the watcher forever (seen once in CI: every request had
finished, and ``Fleet.open``'s exit hung)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tickloom import EngineConfig
from tickloom.fleet.front import Fleet, FleetConfig, _Replica
from tickloom.fleet.wire import Load, ReplicaInfo, encode

pytest.importorskip("ray")  # the watcher catches Ray's actor errors


class _Call:
    def __init__(self, make: Any) -> None:
        self.make = make

    def remote(self, *args: Any) -> Any:
        return self.make()


class _Router:
    """What the watcher and ``_close`` call on the router."""

    def report(self, load: object) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_fleet_closes_when_the_watchers_cancel_lands_as_a_load_call_completes(tmp_path: Any) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        fleet = Fleet(EngineConfig(model="stub"), FleetConfig(replicas=1, fleet_dir=str(tmp_path), load_every=0.01))
        load = encode(Load(0, 0, 0, 8))
        answered = 0

        def load_call() -> asyncio.Future[bytes]:
            # The first call completes in the same callback that closes the fleet, so the watcher's cancel arrives
            # as its wait_for is woken by the result; later calls answer at once.
            nonlocal answered
            answered += 1
            future: asyncio.Future[bytes] = loop.create_future()
            if answered == 1:
                def complete_and_close() -> None:
                    future.set_result(load)
                    closing.append(loop.create_task(fleet._close([])))
                loop.call_soon(complete_and_close)
            else:
                future.set_result(load)
            return future

        async def closed() -> None:
            return None

        handle = type("Handle", (), {"load": _Call(load_call), "close": _Call(closed)})()
        fleet.replicas = [_Replica(handle, ReplicaInfo(0, 0, 1, "here", "log", 16, 8))]
        fleet.router = _Router()  # type: ignore[assignment]
        closing: list[asyncio.Task[None]] = []
        fleet._watcher = loop.create_task(fleet._watch())
        while not closing:
            await asyncio.sleep(0.005)
        # a hang detector, not a timing bound: without the flag the close never ends (asyncio.wait cancels nothing)
        done, _ = await asyncio.wait(closing, timeout=30)
        assert done, "closing the fleet waits for a watcher that never stops"
        assert fleet._watcher.done()

    asyncio.run(main())
