"""The step actor: hosts the ``SchedulerCore`` and drives ticks.

    loop:
      wait until there is an input, or the core asked for another tick (TickOutputs.needs_tick)
      inputs  = drain the inbox, sorted by (source, sequence)   # arrival order within a tick never matters
      outputs = core.tick(TickInputs(tick, now_ns, inputs))      # pure
      append one log frame holding both                          # nothing leaves before its tick is logged
      dispatch outputs.commands, never waiting on a receiver;
        EmitTokens and Finish last, after a flush of the log to the OS  # acknowledged means logged

A crash between ``core.tick`` and the append loses nothing: no command of that tick has left yet.

**Acknowledged means logged.** ``EmitTokens`` and ``Finish`` go to the retire actor, which owns the client
streams. Before a tick's ``EmitTokens`` or ``Finish`` are delivered, its frame (and every earlier one) is handed to
the OS with ``write(2)``, so a token a client has received is in the log even if the process is killed
(``kill -9``) the next instant. Ticks with nothing client-visible stay buffered for the log actor's timed flush.
Whether a frame also survives a crash of the *machine* is the ``fsync`` policy's business; see ``actors.log``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from tickloom.actors.log import LogActor
from tickloom.actors.mailbox import Envelope
from tickloom.engine.core import SchedulerCore
from tickloom.engine.core.snapshot import encode_snapshot
from tickloom.events import (
    Command,
    EmitTokens,
    Input,
    Preempted,
    RunStep,
    SnapshotRecord,
    TickInputs,
)
from tickloom.events.routing import ROUTES, Actor


class Submits(Protocol):
    def submit_nowait(self, command: Command) -> None: ...


class Delivers(Protocol):
    def deliver_nowait(self, commands: list[Command]) -> None: ...


@attrs.define(slots=True)
class StepStats:
    ticks: int = 0
    steps: int = 0
    rows: int = 0
    tokens: int = 0
    preemptions: int = 0
    swaps: int = 0
    log_ns: int = 0
    """Thread CPU time the step actor spends encoding log frames and writing them (its flushes before tokens or a
    finish reach a client; not the flushes of a large buffer or the log actor's timed ones, nor fsyncs)."""
    log_bytes: int = 0


class StepActor:
    """Runs ticks; see the module docstring. ``fsync``: ``"never"``, ``"tick"`` or ``"<N>ms"``."""

    def __init__(
        self,
        core: SchedulerCore,
        inbox: trio.MemoryReceiveChannel[Envelope],
        *,
        device: Submits,
        deadlines: Submits,
        retire: Delivers,
        spill: Submits | None,
        swap_in: Submits | None,
        log: LogActor | None,
        fsync: str = "never",
        snapshot_every: int = 0,
        clock_ns: Callable[[], int] | None = None,
    ) -> None:
        self.core = core
        self._inbox = inbox
        self._device = device
        self._deadlines = deadlines
        self._retire = retire
        self._spill = spill
        self._swap_in = swap_in
        self._log = log
        self._writer = log.writer if log is not None else None
        self._fsync = fsync
        self._snapshot_every = snapshot_every
        self._clock_ns = clock_ns or (lambda: int(trio.current_time() * 1e9))
        self.tick = 0
        self.stats = StepStats()
        self.idle = trio.Event()
        """Set whenever the core holds no live request (used by ``drain``)."""
        self.shut_down = trio.Event()

    async def run(self) -> None:
        needs_tick = False
        while True:
            batch: list[Envelope] = []
            if not needs_tick:
                batch.append(await self._inbox.receive())
            else:
                await trio.lowlevel.checkpoint()
            while True:
                try:
                    batch.append(self._inbox.receive_nowait())
                except trio.WouldBlock:
                    break
            batch.sort()
            needs_tick = await self.run_tick([envelope.msg for envelope in batch])
            if self.core.state.shut_down:
                self.shut_down.set()

    async def run_tick(self, inputs: list[Input]) -> bool:
        tick_inputs = TickInputs(self.tick, self._clock_ns(), inputs)
        outputs = self.core.tick(tick_inputs)
        self.tick += 1
        if self._writer is not None:
            started = time.thread_time_ns()
            size = self._writer.append_tick(tick_inputs, outputs, self.core.last_encoded_commands)
            if self._snapshot_every and outputs.tick % self._snapshot_every == self._snapshot_every - 1:
                state = encode_snapshot(self.core.snapshot())
                size += self._writer.append_snapshot(SnapshotRecord(outputs.tick, outputs.digest, state))
            self.stats.log_ns += time.thread_time_ns() - started
            self.stats.log_bytes += size
            if self._fsync == "tick":
                await self._log.sync()  # type: ignore[union-attr]
        self.dispatch(outputs.commands)
        self.stats.ticks += 1
        if self.core.state.seqs:
            if self.idle.is_set():
                self.idle = trio.Event()
        else:
            self.idle.set()
        return outputs.needs_tick

    def dispatch(self, commands: list[Command]) -> None:
        """Hand each command to its actors, by the one routing table (``events.routing.ROUTES``). Never blocks: every
        hand-off is ``*_nowait`` into a bounded buffer. Tokens and finishes are held back to the end of the tick (see
        ``_flush_for_clients``)."""
        to_retire: list[Command] = []
        stats = self.stats
        for command in commands:
            for actor in ROUTES[type(command)]:
                if actor is Actor.DEVICE:
                    self._device.submit_nowait(command)
                elif actor is Actor.RETIRE:
                    to_retire.append(command)
                elif actor is Actor.SPILL:
                    # A SpillOut reaches the store after the device queue: before the device can hand the copy over.
                    assert self._spill is not None
                    self._spill.submit_nowait(command)
                elif actor is Actor.DEADLINES:
                    self._deadlines.submit_nowait(command)
                elif actor is Actor.SWAP_IN:
                    assert self._swap_in is not None
                    self._swap_in.submit_nowait(command)
            if isinstance(command, RunStep):
                stats.steps += 1
                stats.rows += len(command.request_ids)
            elif isinstance(command, EmitTokens):
                stats.tokens += len(command.token_ids)
            elif isinstance(command, Preempted):
                stats.preemptions += 1
                stats.swaps += command.mode == "swap"
        if to_retire:
            self._flush_for_clients()
            self._retire.deliver_nowait(to_retire)
        elif self._log is not None:
            self._log.flush_if_large()

    def _flush_for_clients(self) -> None:
        """Acknowledged means logged: before tokens or a finish reach a client, this tick's frame (and every earlier
        one) is handed to the OS (see the module docstring). The other commands have left already, so the device
        starts the next step while this writes. A failed write raises ``LogWriteFailed``, and nothing is delivered.
        """
        if self._log is None:
            return
        started = time.thread_time_ns()
        self._log.flush()
        self.stats.log_ns += time.thread_time_ns() - started
