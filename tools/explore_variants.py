"""Deliberately broken actor variants, for testing that the actor-level race explorer finds real races.

Each variant is a context manager that swaps one actor class in ``tickloom.runtime`` (the module that builds the
actors) for a broken subclass and puts the real one back on exit. Nothing in the public API reaches them: they are
enabled only by ``tickloom explore --variant NAME`` (a hidden flag) or by a test.

* ``deadline-keyerror``: the deadline actor of commit 48fbc6e. Its timer sleeps until the earliest deadline and,
  on waking, pops and reports it without asking the watch table again; an ``UnwatchDeadline`` received while it
  slept does not wake it. So a request that finished before its deadline is "reached" anyway, and
  ``del self._live[request_id]`` raises ``KeyError``: a fatal engine error.
* ``drop-overtakes-copy``: a spill actor that deletes a copy on ``DropSpill`` at once, even while the copy is still
  on its way from the device. The copy then arrives after its request ended and stays in the host tier for good.
* ``retire-before-log``: a step actor that hands a tick's ``EmitTokens``/``Finish`` to the retire actor *before*
  writing the tick's frame to the OS, breaking "acknowledged means logged".
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import trio

import tickloom.runtime as runtime_module
from tickloom.actors.deadlines import DeadlineActor
from tickloom.actors.mailbox import ChannelOverflow
from tickloom.actors.spill import SpillActor
from tickloom.actors.step import StepActor
from tickloom.events import Command, DeadlineReached, EmitTokens, Finish, SpillDone, UnwatchDeadline, WatchDeadline
from tickloom.replay.variants import patched


class WakeBlindDeadlineActor(DeadlineActor):
    """``actors/deadlines.py`` as of commit 48fbc6e (the bug: a wake-up trusts the heap it slept on)."""

    def submit_nowait(self, command: Command) -> None:
        if isinstance(command, WatchDeadline):
            if len(self._live) >= self._limit:
                raise ChannelOverflow(f"deadline actor is watching {self._limit} requests, its bound")
            self._live[command.request_id] = command.deadline_ns
            heapq.heappush(self._heap, (command.deadline_ns, command.request_id))
            self._changed.set()
        elif isinstance(command, UnwatchDeadline):
            self._live.pop(command.request_id, None)

    async def run(self) -> None:
        while True:
            while self._heap and self._live.get(self._heap[0][1]) != self._heap[0][0]:
                heapq.heappop(self._heap)  # unwatched or re-watched
            wake_at = self._heap[0][0] / 1e9 if self._heap else math.inf
            with trio.move_on_at(wake_at):
                await self._changed.wait()
                self._changed = trio.Event()
                continue
            deadline_ns, request_id = heapq.heappop(self._heap)
            del self._live[request_id]
            await self._outbox.send(DeadlineReached(request_id, deadline_ns))


class EagerDropSpillActor(SpillActor):
    """Forgets that a copy may still be in flight: ``DropSpill`` deletes whatever is stored now, nothing later."""

    async def run(self) -> None:
        async for kind, request_id, kv, error in self._receive:
            if kind == "drop":
                await trio.to_thread.run_sync(self.store.drop, request_id)
            elif kind == "copy":
                if kv is None:
                    await self._outbox.send(SpillDone(request_id, False, error))
                else:
                    await self._store(request_id, kv)


class RetireFirstStepActor(StepActor):
    """Delivers a tick's tokens and finishes to the retire actor first, and only then writes the tick's frame."""

    def dispatch(self, commands: list[Command]) -> None:
        visible: list[Command] = [c for c in commands if isinstance(c, EmitTokens | Finish)]
        if visible:
            self._retire.deliver_nowait(visible)
        super().dispatch([c for c in commands if not isinstance(c, EmitTokens | Finish)])
        if visible:
            self._flush_for_clients()


def _swap(name: str, replacement: type) -> AbstractContextManager[None]:
    return patched(runtime_module, name, replacement)


VARIANTS: dict[str, Callable[[], AbstractContextManager[None]]] = {
    "deadline-keyerror": lambda: _swap("DeadlineActor", WakeBlindDeadlineActor),
    "drop-overtakes-copy": lambda: _swap("SpillActor", EagerDropSpillActor),
    "retire-before-log": lambda: _swap("StepActor", RetireFirstStepActor),
}
"""Name -> a context manager that enables the broken variant for the engines built inside it."""


@contextmanager
def enabled(name: str | None) -> Iterator[None]:
    """Enable the variant ``name`` (None: the real code) for engines built inside the block."""
    if name is None:
        yield
        return
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(sorted(VARIANTS))}")
    with VARIANTS[name]():
        yield


__all__ = ["VARIANTS", "EagerDropSpillActor", "RetireFirstStepActor", "WakeBlindDeadlineActor", "enabled"]
