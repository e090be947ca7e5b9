"""The explorer's checks, both levels: one ``Violation``, and what each level's runs must satisfy.

Core level (``tools.explore.core``), beyond ``check_invariants()``: ``ClientCheck`` reads only what a log holds (each
tick's inputs and outputs), so the same check runs on a live run and on a written log (``check_client_log``);
``StrandCheck`` and ``check_end`` read the core's state, and ``StrandCheck`` is a ``replay.bisect`` check too.

Actor level (``tools.explore.actors``): ``Monitor`` collects what a run saw (each client's frames, the ticks, a fatal
error) and the first violation. Violations found inside an actor (a core invariant after a tick, a delivery to the
retire actor before the tick's frame is in the file, a tick storm) stop the engine through ``Monitor.stop``; the
others are found after the run: the end state (``check_end_state``, inside the engine), the fatal error
(``check_fatal``) and the log (``check_actor_log``: endings, tokens, reasons, replay).

Nothing here imports trio: the core level runs without it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from tickloom.engine.core import SchedulerCore
from tickloom.engine.core.blocks import blocks_for
from tickloom.engine.core.errors import InvariantViolation
from tickloom.engine.core.status import Status
from tickloom.engine.errors import EngineError
from tickloom.events import EmitTokens, Finish, LogReader, RequestArrived, StopMatched, TickInputs, TickOutputs
from tickloom.replay import verify

if TYPE_CHECKING:
    from tickloom.api import Engine
    from tickloom.engine.outputs import RequestOutput


@dataclasses.dataclass(frozen=True, slots=True)
class Violation:
    """What a run broke: ``kind``, at ``tick`` (the core level's; None at the actor level, whose runs are timed in
    virtual seconds), and how. The core level's kinds: ``invariant``, ``crash``, ``ending``, ``order``,
    ``overrun``, ``stop``, ``deadline``, ``stranded``, ``liveness``, ``conservation``, ``replay``; the actor level's:
    ``invariant``, ``unlogged delivery``, ``liveness``, ``fatal``, ``endings``, ``client``, ``reason``,
    ``conservation``, ``crash``, ``log``, ``replay``."""

    kind: str
    tick: int | None
    detail: str

    def __str__(self) -> str:
        where = f" at tick {self.tick}" if self.tick is not None else ""
        return f"{self.kind}{where}: {self.detail}"


# -- the core level ----------------------------------------------------------------------------------------------
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


def check_client_log(path: str | os.PathLike[str]) -> Violation | None:
    """``ClientCheck`` over a written log's ticks: the first client-visible violation it holds, or None."""
    check = ClientCheck()
    with LogReader(path) as reader:
        for record in reader.ticks():
            violation = check.observe(record.inputs, record.outputs)
            if violation is not None:
                return violation
    return None


# -- the actor level ---------------------------------------------------------------------------------------------
class ViolationStop(RuntimeError):
    """Raised inside an actor to stop the engine at a violation (the monitor has recorded it)."""


@attrs.frozen
class Expect:
    """What the script says about one request: which endings it allows."""

    prompt_len: int
    max_tokens: int
    deadline: bool
    stop_strings: bool
    stop_tokens: bool
    cancellable: bool
    """The script cancels it or leaves its stream early."""
    swap_in_fails: bool


@attrs.define
class Seen:
    """What one client saw."""

    frames: list[RequestOutput] = attrs.Factory(list)
    tokens: list[int] = attrs.Factory(list)
    final: RequestOutput | None = None
    left_early: bool = False
    rejected: bool = False
    error: EngineError | None = None
    stream: Any = None
    stream_failed: bool = False
    """When the client stopped reading, its stream held the engine's fatal error."""

    def note_stream_state(self) -> None:
        inner = getattr(self.stream, "_inner", None)
        self.stream_failed = inner is not None and inner._stream.error is not None


@attrs.define
class Monitor:
    requests: dict[str, Expect]
    fail_steps: frozenset[int]
    crash: str | None
    max_seq_len: int
    seen: dict[str, Seen] = attrs.Factory(dict)
    violation: Violation | None = None
    fatal: EngineError | None = None
    ticks: int = 0
    virtual_s: float = 0.0

    def __attrs_post_init__(self) -> None:
        self.seen = {rid: Seen() for rid in self.requests}

    def fail(self, kind: str, detail: str) -> None:
        """Record a violation (the first one of a run is the one reported)."""
        if self.violation is None:
            self.violation = Violation(kind, None, detail)

    def stop(self, kind: str, detail: str) -> ViolationStop:
        """Record a violation and return the exception that stops the engine."""
        self.fail(kind, detail)
        return ViolationStop(f"{kind}: {detail}")

    def check_end_state(self, engine: Engine) -> None:
        """Everything back to baseline once every request ended (called inside the engine, after settling)."""
        rt = engine.runtime
        stats = engine.stats()
        problems = []
        if rt.live:
            problems.append(f"requests still live: {sorted(rt.live)}")
        queues = {k: stats[k] for k in ("waiting", "running", "preempted", "swapped") if stats[k]}
        if queues:
            problems.append(f"queues not empty: {queues}")
        if stats["blocks_free"] + stats["blocks_cached"] != stats["blocks_total"]:
            problems.append(f"blocks leaked: {stats['blocks_free']} free + {stats['blocks_cached']} cached of "
                            f"{stats['blocks_total']}")
        if rt.free_slots != rt.core_config.max_waiting:
            problems.append(f"submit slots leaked: {rt.free_slots} free of {rt.core_config.max_waiting}")
        if rt.deadlines.watched:
            problems.append(f"{rt.deadlines.watched} deadline watches outlive their requests")
        if rt.store is not None and rt.store.held:
            problems.append(f"{rt.store.held} spilled copies outlive their requests")
        if rt.retire.open_streams:
            problems.append(f"{rt.retire.open_streams} client streams still open in the retire actor")
        if problems:
            self.fail("conservation", "; ".join(problems))

    def check_fatal(self) -> None:
        """A fatal error must be the planned crash; then every stream the engine had open must have got it."""
        fatal = self.fatal
        if fatal is None or self.violation is not None:
            return
        if self.crash is None or fatal.actor != self.crash or "injected crash" not in str(fatal):
            self.fail("fatal", f"unexpected fatal engine error: {fatal}")
            return
        for rid, seen in sorted(self.seen.items()):
            if seen.stream is None or seen.final is not None or seen.left_early or seen.error is not None:
                continue
            if not seen.stream_failed:
                self.fail("crash", f"{rid}: its stream was still open, without the EngineError, after the crash")
                return


def check_actor_log(monitor: Monitor, path: Path, *, verify_replay: bool = True) -> None:
    """Endings exactly once, tokens in order and never after a finish, reasons the script explains, the client's
    view consistent with the log, and an ``identical`` replay."""
    arrived: set[str] = set()
    finishes: dict[str, Finish] = {}
    logged: dict[str, list[int]] = {}
    with LogReader(path) as reader:
        for record in reader.ticks():
            for msg in record.inputs.inputs:
                if isinstance(msg, RequestArrived):
                    arrived.add(msg.request_id)
            for command in record.outputs.commands:
                if isinstance(command, EmitTokens):
                    for rid, token, index in zip(command.request_ids, command.token_ids, command.token_indices,
                                                 strict=True):
                        out = logged.setdefault(rid, [])
                        if rid in finishes:
                            monitor.fail("endings", f"tick {record.inputs.tick}: token {index} of {rid} after "
                                         "its Finish")
                        elif index != len(out):
                            monitor.fail("endings", f"tick {record.inputs.tick}: token {index} of {rid} after "
                                         f"{len(out)} tokens")
                        out.append(token)
                elif isinstance(command, Finish):
                    if command.request_id in finishes:
                        monitor.fail("endings", f"tick {record.inputs.tick}: {command.request_id} finished twice")
                    finishes[command.request_id] = command
    clean = monitor.fatal is None
    for rid in sorted(arrived):
        if clean and rid not in finishes:
            monitor.fail("endings", f"{rid} arrived but never finished")
    for rid, seen in sorted(monitor.seen.items()):
        _check_client(monitor, rid, seen, rid in arrived, finishes.get(rid), logged.get(rid, []), clean)
    if verify_replay:
        report = verify(path)
        if report.status != "identical":
            monitor.fail("replay", report.format_text())


def _check_client(monitor: Monitor, rid: str, seen: Seen, arrived: bool, finish: Finish | None, logged: list[int],
                  clean: bool) -> None:
    if seen.rejected:
        if arrived:
            monitor.fail("client", f"{rid} was rejected at submit, yet it arrived")
        return
    if seen.tokens != logged[: len(seen.tokens)]:
        monitor.fail("client", f"{rid}: the client's tokens are not the logged ones ({seen.tokens} vs {logged})")
    finals = sum(f.finished for f in seen.frames)
    if finals > 1:
        monitor.fail("client", f"{rid} got {finals} final frames")
    if not clean or seen.stream is None:
        return
    if not arrived:
        monitor.fail("endings", f"{rid} was submitted but never arrived")
        return
    if finish is not None:
        _check_reason(monitor, rid, finish, len(logged))
    if seen.left_early:
        return
    final = seen.final
    if final is None:
        monitor.fail("client", f"{rid}: the stream ended without a final frame")
        return
    if final.usage is None or final.usage.completion_tokens != len(seen.tokens):
        monitor.fail("client", f"{rid}: usage {final.usage} does not count the {len(seen.tokens)} tokens received")
    if finish is not None and final.finish_reason != finish.reason and not (
            final.finish_reason == "stop" and monitor.requests[rid].stop_strings):
        monitor.fail("client", f"{rid}: the client saw {final.finish_reason!r}, the core logged {finish.reason!r}")


_STEP_FAILED = re.compile(r"step (\d+) failed")


def _check_reason(monitor: Monitor, rid: str, finish: Finish, tokens: int) -> None:
    want = monitor.requests[rid]
    reason = finish.reason
    if reason == "length":
        ok = tokens == want.max_tokens or want.prompt_len + tokens >= monitor.max_seq_len
    elif reason == "stop":
        ok = want.stop_strings or want.stop_tokens
    elif reason == "timeout":
        ok = want.deadline
    elif reason == "cancelled":
        ok = want.cancellable
    elif reason == "error":
        step = _STEP_FAILED.search(finish.error)
        ok = (step is not None and int(step.group(1)) in monitor.fail_steps) or (
            want.swap_in_fails and "swap-in" in finish.error)
    else:
        ok = False
    if not ok:
        monitor.fail("reason", f"{rid} finished {reason!r} ({finish.error or 'no error'}) after {tokens} tokens; "
                     f"its script allows no such ending ({want})")
