"""The checks of the actor-level race explorer (``tools.explore_actors``): what each run must satisfy.

``Monitor`` collects what a run saw (each client's frames, the ticks, a fatal error) and the first violation.
Violations found inside an actor (a core invariant after a tick, a delivery to the retire actor before the tick's
frame is in the file, a tick storm) stop the engine through ``Monitor.stop``; the others are found after the run:
the end state (``check_end_state``, inside the engine), the fatal error (``check_fatal``) and the log
(``check_log``: endings, tokens, reasons, replay).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs

from tickloom import Engine, EngineError, RequestOutput
from tickloom.events import EmitTokens, Finish, LogReader, RequestArrived
from tickloom.replay import verify


@attrs.frozen
class Violation:
    kind: str
    """``invariant``, ``unlogged delivery``, ``liveness``, ``fatal``, ``endings``, ``client``, ``reason``,
    ``conservation``, ``crash``, ``log`` or ``replay``."""
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


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
            self.violation = Violation(kind, detail)

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


def check_log(monitor: Monitor, path: Path, *, verify_replay: bool = True) -> None:
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


__all__ = ["Expect", "Monitor", "Seen", "Violation", "ViolationStop", "check_log"]
