"""How inputs reach the step actor: one bounded inbox, stamped by (source, per-source sequence).

Channel rules (ARCHITECTURE.md, "Channels"):

* Edges **into** the step actor block when the inbox is full. That is backpressure, and safe, because the step
  actor never waits on anything but its inbox and the log.
* Edges **out of** the step actor never block: it hands commands to each actor with a ``*_nowait`` call into a
  bounded buffer sized well above what the core can have outstanding. Overflowing one is a fatal engine error
  naming the actor, never a silent drop and never a wait that could close a cycle.
* An actor that must report while it receives (retire's stop matches, clients leaving) reports through a
  ``Reporter``: a bounded buffer and a forwarding task, so its receive loop never waits on the inbox.
"""

from __future__ import annotations

from collections import deque
from enum import IntEnum

import attrs
import trio

from tickloom.events import Input


class Source(IntEnum):
    """Who sent an input; a tick's inputs are applied sorted by (source, sequence)."""

    CLIENT = 0
    DEVICE = 1
    SPILL = 2
    SWAP_IN = 3
    RETIRE = 4
    DEADLINE = 5


@attrs.frozen(slots=True, order=True)
class Envelope:
    source: int
    seq: int
    msg: Input = attrs.field(order=False)


class ChannelOverflow(RuntimeError):
    """A bounded hand-off out of the step actor overflowed: a fatal engine error naming the actor."""


class Outbox:
    """One source's sending end of the inbox; stamps each input with the source's next sequence number."""

    def __init__(self, source: Source, send: trio.MemorySendChannel[Envelope]) -> None:
        self.source = source
        self._send = send
        self._seq = 0

    def _stamp(self, msg: Input) -> Envelope:
        self._seq += 1
        return Envelope(int(self.source), self._seq, msg)

    async def send(self, msg: Input) -> None:
        await self._send.send(self._stamp(msg))


class Reporter:
    """A non-blocking way into the inbox for code that must not wait: bounded, forwarded by ``run``."""

    def __init__(self, outbox: Outbox, limit: int, name: str, delay: float = 0.0) -> None:
        self._outbox = outbox
        self._delay = delay
        self._pending: deque[Input] = deque()
        self._limit = limit
        self._name = name
        self._wakeup = trio.Event()
        self._reported = 0
        self._sent = 0
        self._sent_lot = trio.lowlevel.ParkingLot()

    def report_nowait(self, msg: Input) -> None:
        if len(self._pending) >= self._limit:
            raise ChannelOverflow(f"{self._name} reporter overflowed its bound of {self._limit} pending inputs")
        self._pending.append(msg)
        self._reported += 1
        self._wakeup.set()

    async def wait_flushed(self) -> None:
        """Wait until everything reported so far is in the inbox.

        Why: the engine's shutdown goes into the inbox directly, not through here. Without this, a stream closed
        just before the engine (its ``ClientGone`` still pending here) would reach the core after ``Shutdown`` and
        end as a shutdown error rather than cancelled.
        """
        target = self._reported
        while self._sent < target:
            await self._sent_lot.park()

    async def run(self) -> None:
        while True:
            while self._pending:
                if self._delay:
                    await trio.sleep(self._delay)
                await self._outbox.send(self._pending.popleft())
                self._sent += 1
                self._sent_lot.unpark_all()
            await self._wakeup.wait()
            self._wakeup = trio.Event()
