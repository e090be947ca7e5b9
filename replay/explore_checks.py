"""The core-level explorer's checks beyond ``check_invariants()`` (see ``replay.explore``).

``ClientCheck`` reads only what a log holds (each tick's inputs and outputs), so the same check runs on a live run
and on a written log (``check_log``); ``StrandCheck`` and ``check_end`` read the core's state, and ``StrandCheck``
is a ``replay.bisect`` check too.
"""

from __future__ import annotations

import dataclasses
import os

from tickloom.engine.core import SchedulerCore
from tickloom.engine.core.blocks import blocks_for
from tickloom.engine.core.errors import InvariantViolation
from tickloom.engine.core.status import Status
from tickloom.events import EmitTokens, Finish, LogReader, RequestArrived, StopMatched, TickInputs, TickOutputs


@dataclasses.dataclass(frozen=True, slots=True)
class Violation:
    """What a run broke: ``kind`` (``invariant``, ``crash``, ``ending``, ``order``, ``overrun``, ``stop``,
    ``deadline``, ``stranded``, ``liveness``, ``conservation``, ``replay``), at ``tick``, and how."""

    kind: str
    tick: int
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} at tick {self.tick}: {self.detail}"


class ClientCheck:
    """The clients' view, tick by tick: one ``Finish`` per request and no token after it; token indices in order;
    the tokens streamed are the ones the finish counts, unless a stop match truncated the request; a
    ``StopMatched(k)`` delivered while its request is live caps its completion count at k + 1 (the earliest index
    wins); no request is still live after a tick whose ``now_ns`` reached its deadline."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.streamed: dict[str, int] = {}
        self.finished: dict[str, Finish] = {}
        self.stops: dict[str, int] = {}
        self.deadlines: dict[str, int] = {}

    def observe(self, inputs: TickInputs, outputs: TickOutputs) -> Violation | None:
        tick = inputs.tick
        for msg in inputs.inputs:
            if isinstance(msg, RequestArrived):
                self.live.add(msg.request_id)
                self.streamed[msg.request_id] = 0
                if msg.deadline_ns is not None:
                    self.deadlines[msg.request_id] = msg.deadline_ns
            elif isinstance(msg, StopMatched) and msg.request_id in self.live:
                self.stops[msg.request_id] = min(msg.token_index, self.stops.get(msg.request_id, msg.token_index))
        for command in outputs.commands:
            if isinstance(command, EmitTokens):
                for rid, index in zip(command.request_ids, command.token_indices, strict=True):
                    if rid in self.finished:
                        return Violation("ending", tick, f"{rid}: token index {index} streamed after its finish "
                                         f"({self.finished[rid].reason})")
                    if index != self.streamed.get(rid):
                        return Violation("order", tick, f"{rid}: token index {index} streamed after "
                                         f"{self.streamed.get(rid)} tokens")
                    self.streamed[rid] = index + 1
            elif isinstance(command, Finish):
                problem = self._finish(command)
                if problem is not None:
                    return Violation(problem[0], tick, problem[1])
        now = inputs.now_ns
        for rid, deadline in self.deadlines.items():
            if deadline <= now and rid in self.live:
                return Violation("deadline", tick, f"{rid} is still live at now {now} ns, past its deadline "
                                 f"{deadline} ns")
        return None

    def _finish(self, finish: Finish) -> tuple[str, str] | None:
        rid = finish.request_id
        if rid in self.finished:
            return "ending", f"{rid} finished twice ({self.finished[rid].reason}, then {finish.reason})"
        self.finished[rid] = finish
        self.live.discard(rid)
        self.deadlines.pop(rid, None)
        counted = finish.usage.completion_tokens
        streamed = self.streamed.get(rid, 0)
        stop = self.stops.get(rid)
        if stop is None and counted != streamed:
            return "overrun", f"{rid} streamed {streamed} tokens but its finish ({finish.reason}) counts {counted}"
        if stop is not None and counted > stop + 1:
            return "stop", (f"{rid}: a stop matched at token index {stop} while it was live, yet it finished as "
                            f"{finish.reason} with {counted} tokens (the earliest index must win)")
        if counted > streamed:
            return "overrun", f"{rid}: its finish counts {counted} tokens, {streamed} were streamed"
        return None


class StrandCheck:
    """Liveness of swap-in: a swapped sequence whose KV is ready must not stay parked more than ``ticks`` ticks
    while the batch has room and the free plus (reclaimable) cached blocks would hold it. Call it after each tick;
    it raises ``InvariantViolation("liveness", ...)`` (so it also serves ``replay.bisect(path, check=...)``)."""

    def __init__(self, ticks: int) -> None:
        self.ticks = ticks
        self.parked: dict[str, int] = {}

    def __call__(self, core: SchedulerCore) -> None:
        state = core.state
        config = state.config
        room = state.active < config.max_batch_size
        available = state.pool.num_free + state.pool.num_cached
        parked: dict[str, int] = {}
        for seq in state.swapping_or_swapped:
            if (room and seq.status is Status.SWAPPED and seq.swap_ready
                    and blocks_for(seq.spill_tokens, config.block_size) <= available):
                parked[seq.request_id] = count = self.parked.get(seq.request_id, 0) + 1
                if count > self.ticks:
                    raise InvariantViolation(
                        "liveness", f"{seq.request_id!r} stranded: swapped with its KV ready for {count} ticks "
                        f"while {state.pool.num_free} free + {state.pool.num_cached} cached blocks would hold its "
                        f"{blocks_for(seq.spill_tokens, config.block_size)} and the batch has room")
        self.parked = parked


def check_end(core: SchedulerCore, live: set[str], tick: int) -> Violation | None:
    """After draining: every request ended, and every block is free or cached with nothing held."""
    if live:
        return Violation("liveness", tick, f"requests {sorted(live)} never ended")
    state = core.state
    pool = state.pool
    if state.seqs or state.steps or state.fences:
        return Violation("conservation", tick, f"left after draining: {len(state.seqs)} requests, "
                         f"{len(state.steps)} steps in flight, {len(state.fences)} fences")
    if pool.num_free + pool.num_cached != pool.num_blocks or any(pool.ref):
        held = [block for block, ref in enumerate(pool.ref) if ref]
        return Violation("conservation", tick, f"free {pool.num_free} + cached {pool.num_cached} != "
                         f"{pool.num_blocks} blocks after draining; held: {held}")
    return None


def check_log(path: str | os.PathLike[str]) -> Violation | None:
    """``ClientCheck`` over a written log's ticks: the first client-visible violation it holds, or None."""
    check = ClientCheck()
    with LogReader(path) as reader:
        for record in reader.ticks():
            violation = check.observe(record.inputs, record.outputs)
            if violation is not None:
                return violation
    return None
