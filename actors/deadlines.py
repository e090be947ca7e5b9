"""The deadline actor: a timer heap that wakes the engine at each request's deadline.

Two tasks, so that receiving ``WatchDeadline`` never waits on sending ``DeadlineReached``: the receive side
only edits the heap; the timer side sleeps until the earliest deadline and reports it.
"""

from __future__ import annotations

import heapq
import math

import trio

from actors.mailbox import ChannelOverflow, Outbox
from events import Command, DeadlineReached, UnwatchDeadline, WatchDeadline


class DeadlineActor:
    def __init__(self, outbox: Outbox, limit: int) -> None:
        self._outbox = outbox
        self._limit = limit
        self._heap: list[tuple[int, str]] = []
        self._live: dict[str, int] = {}
        self._changed = trio.Event()

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
