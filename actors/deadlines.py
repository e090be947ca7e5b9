"""The deadline actor: a timer heap that wakes the engine at each request's deadline.

Two tasks, so that receiving ``WatchDeadline`` never waits on sending ``DeadlineReached``: the receive side
only edits the watch table (and pushes onto the heap); the timer side sleeps until the earliest deadline and
reports it.

The race that matters: the timer side computes its wake-up time, and while it sleeps the request it is
sleeping for may finish (``UnwatchDeadline``), be re-watched with another deadline, or be unwatched and watched
again. So a wake-up proves nothing by itself. After every wake-up the timer side goes back to the top and asks
the watch table again; only an entry that is still the current watch for its request and is due gets reported.
The heap is lazy (stale entries are skipped when they reach the top), and it is rebuilt when stale entries
outnumber live ones, so its size stays bounded by the requests being watched.
"""

from __future__ import annotations

import heapq
import math

import trio

from tickloom.actors.mailbox import ChannelOverflow, Outbox
from tickloom.events import Command, DeadlineReached, UnwatchDeadline, WatchDeadline


class DeadlineActor:
    def __init__(self, outbox: Outbox, limit: int) -> None:
        self._outbox = outbox
        self._limit = limit
        self._heap: list[tuple[int, str]] = []
        self._live: dict[str, int] = {}
        self._changed = trio.Event()

    @property
    def watched(self) -> int:
        """Requests with a live watch."""
        return len(self._live)

    def submit_nowait(self, command: Command) -> None:
        if isinstance(command, WatchDeadline):
            if command.request_id not in self._live and len(self._live) >= self._limit:
                raise ChannelOverflow(f"deadline actor is watching {self._limit} requests, its bound")
            self._live[command.request_id] = command.deadline_ns
            heapq.heappush(self._heap, (command.deadline_ns, command.request_id))
        elif isinstance(command, UnwatchDeadline):
            self._live.pop(command.request_id, None)
        else:
            return
        if len(self._heap) > 2 * len(self._live) + 16:
            self._heap = [(due, rid) for rid, due in self._live.items()]
            heapq.heapify(self._heap)
        self._changed.set()

    def _drop_stale(self) -> None:
        while self._heap and self._live.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)  # unwatched, or re-watched with another deadline

    async def run(self) -> None:
        while True:
            self._drop_stale()
            wake_at = self._heap[0][0] / 1e9 if self._heap else math.inf
            if trio.current_time() < wake_at:
                with trio.move_on_at(wake_at):
                    await self._changed.wait()
                self._changed = trio.Event()
                continue  # woken by a change or by the timer: look at the table again either way
            deadline_ns, request_id = heapq.heappop(self._heap)
            del self._live[request_id]
            await self._outbox.send(DeadlineReached(request_id, deadline_ns))
