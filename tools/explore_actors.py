"""The race explorer, actor level: the real trio actors and ``Engine`` on the stub device, under ``MockClock``.

One seed is one run, reproducible byte for byte:

* **The script** (``tools.explore_script``): the engine's setup and the clients' actions (submit, cancel, leave
  early, deadlines) and, with ``faults``, failed steps, spill writes and swap-in reads, an actor crash, jittered
  step times, slow copies and spill I/O, late retire reports; all drawn from one ``random.Random(seed)``.
* **The schedule** (``tools.explore_schedule``): trio's own deterministic-scheduling hook, seeded, with the
  ``random``, ``pct`` or ``delay`` policy; ``MockClock(autojump_threshold=0)`` makes time virtual.
* **No other nondeterminism.** ``instrumented`` builds each engine with: spill I/O that the actors hand to threads
  (``trio.to_thread.run_sync``) run inline after a seeded virtual delay; the stub device's step times and copy
  latencies drawn from the seed; spill in the host tier only (no files). Request ids and sampling seeds come from
  the script; the log path is the same for every run of one work directory (the header records it). Nothing
  depends on ``PYTHONHASHSEED`` (a test runs one seed under two hash seeds).

The checks (``tools.explore_checks``): the core's invariants after every tick; at every delivery to the retire
actor, the delivering tick's frame is already in the file; one ending per request, in the log and on the client,
with no token after it; the client's tokens a prefix of the logged ones; finish reasons the script explains;
blocks, queues, submit slots, deadline watches, spilled copies and streams back to baseline; every request ended
within a virtual-time bound, with no tick storm; the log replays ``identical``. With a planned actor crash: the
engine fails with ``EngineError`` naming that actor, every stream still open has that error, nothing hangs.

``explore`` runs seeds until the first violation, then shrinks it (``ddmin`` over the script's actions, keeping
the violation's kind), keeps its log, and describes it with a replay token (``tickloom explore --replay``) and a
pytest regression test. The broken variants the tests find live in ``tools.explore_variants``.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import random
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import msgspec
import trio
import trio.testing

import tickloom.runtime as runtime_module
from tickloom import Engine, EngineConfig, EngineError, EngineOverloaded, SamplingParams
from tickloom.engine.core.errors import InvariantViolation
from tickloom.events import RunStep
from tickloom.replay.shrink import ddmin
from tickloom.tools.explore_checks import Monitor, Seen, Violation, check_log
from tickloom.tools.explore_schedule import STRATEGIES, deterministic_trio
from tickloom.tools.explore_script import (
    Cancel,
    Disconnect,
    Script,
    Submit,
    engine_config,
    make_script,
    monitor_for,
    time_bound,
)
from tickloom.tools.explore_variants import enabled

LEVEL = "actors"
MAX_TICKS = 50_000
"""More ticks than this in one run is a tick storm (a livelock that virtual time cannot see)."""


# -- instrumentation -----------------------------------------------------------------------------------------------
class _CheckedDelivery:
    """Between the step actor and the retire actor: at each delivery the tick's frame must be in the file."""

    def __init__(self, inner: Any, step: Any, monitor: Monitor) -> None:
        self.inner = inner
        self.step = step
        self.monitor = monitor

    def deliver_nowait(self, commands: list[Any]) -> None:
        log = self.step._log
        if log is not None:
            writer = log.writer
            on_disk = os.path.getsize(writer.path)
            if writer.pending_bytes or on_disk != writer.bytes_written:
                raise self.monitor.stop("unlogged delivery", f"tick {self.step.tick - 1}: tokens/finishes reached "
                                        f"the retire actor with {writer.pending_bytes} bytes of frames unwritten "
                                        f"({on_disk} of {writer.bytes_written + writer.pending_bytes} on disk)")
        self.inner.deliver_nowait(commands)


class _SlowCopies:
    """Stands for the spill actor before the stub device: hands each finished copy out over after a delay."""

    def __init__(self, spill: Any, delay: Callable[[], float]) -> None:
        self._spill = spill
        self.store = spill.store
        self._delay = delay
        self._send, self._receive = trio.open_memory_channel[tuple[str, Any, str]](math.inf)

    def accept_nowait(self, request_id: str, kv: Any, error: str = "") -> None:
        self._send.send_nowait((request_id, kv, error))

    async def run(self) -> None:
        async for request_id, kv, error in self._receive:
            await trio.sleep(self._delay())
            self._spill.accept_nowait(request_id, kv, error)


@contextmanager
def instrumented(script: Script, monitor: Monitor) -> Iterator[None]:
    """Build engines inside the block with checked step actors, a jittered stub device and inline spill I/O."""
    s = script.setup
    io_rng = random.Random(script.seed ^ 0x10D1)
    copy_rng = random.Random(script.seed ^ 0xC0B7)
    step_cls: Any = getattr(runtime_module, "StepActor")  # noqa: B009 (the name is patched, and put back)
    device_cls: Any = getattr(runtime_module, "StubDevice")  # noqa: B009
    real_to_thread = trio.to_thread.run_sync

    def make_step(*args: Any, **kw: Any) -> Any:
        step = step_cls(*args, **kw)
        run_tick = step.run_tick

        async def checked_run_tick(inputs: list[Any]) -> bool:
            needs = await run_tick(inputs)
            monitor.ticks += 1
            if monitor.ticks > MAX_TICKS:
                raise monitor.stop("liveness", f"more than {MAX_TICKS} ticks: a tick storm")
            try:
                step.core.check_invariants()
            except InvariantViolation as exc:
                raise monitor.stop("invariant", f"after tick {step.tick - 1}: {exc}") from exc
            return bool(needs)

        step.run_tick = checked_run_tick  # an instance attribute: ``run`` calls it for every tick
        step._retire = _CheckedDelivery(step._retire, step, monitor)
        return step

    def make_device(*args: Any, **kw: Any) -> Any:
        def step_time(step: RunStep) -> float:
            if not s.step_jitter:
                return s.step_time
            u = random.Random(script.seed * 1_000_003 + step.step_id).random()
            return s.step_time * (1.0 + s.step_jitter * (2.0 * u - 1.0))

        kw["step_time"] = step_time
        if not s.copy_delay:
            return device_cls(*args, **kw)
        outbox, spill, *rest = args
        copies = _SlowCopies(spill, lambda: copy_rng.uniform(0.0, s.copy_delay)) if spill is not None else None
        device = device_cls(outbox, copies, *rest, **kw)
        if copies is not None:
            device_run = device.run

            async def run_with_copies() -> None:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(copies.run)
                    await device_run()
                    nursery.cancel_scope.cancel()

            device.run = run_with_copies  # read by the runtime when it starts the actors
        return device

    async def inline(fn: Callable[..., Any], *args: Any, **_kw: Any) -> Any:
        delay = io_rng.uniform(0.0, s.io_delay) if s.io_delay else 0.0
        if delay:
            await trio.sleep(delay)
        else:
            await trio.lowlevel.checkpoint()
        return fn(*args)

    setattr(runtime_module, "StepActor", make_step)  # noqa: B010
    setattr(runtime_module, "StubDevice", make_device)  # noqa: B010
    setattr(trio.to_thread, "run_sync", inline)  # noqa: B010
    try:
        yield
    finally:
        setattr(runtime_module, "StepActor", step_cls)  # noqa: B010
        setattr(runtime_module, "StubDevice", device_cls)  # noqa: B010
        setattr(trio.to_thread, "run_sync", real_to_thread)  # noqa: B010


# -- one run -------------------------------------------------------------------------------------------------------
@attrs.define
class RunResult:
    script: Script
    strategy: str
    log: Path
    violation: Violation | None
    ticks: int
    virtual_s: float
    fatal: str | None
    """The engine's fatal error, if it had one (a planned crash, or a violation)."""


async def _client(engine: Engine, sub: Submit, leave: int | None, seen: Seen, monitor: Monitor) -> None:
    await trio.sleep_until(sub.at)
    params = SamplingParams(max_tokens=sub.max_tokens, min_tokens=0, seed=sub.seed, temperature=sub.temperature,
                            stop=list(sub.stop), stop_token_ids=list(sub.stop_token_ids))
    try:
        async with engine.stream(sub.prompt, params, deadline=sub.deadline, request_id=sub.rid,
                                 priority=sub.priority) as stream:
            seen.stream = stream
            try:
                if leave == 0:
                    seen.left_early = True
                    return
                async for out in stream:
                    if seen.final is not None:
                        monitor.fail("client", f"{sub.rid}: a frame after its final frame")
                    seen.frames.append(out)
                    seen.tokens += out.token_ids
                    if out.finished:
                        seen.final = out
                    elif leave is not None and len(seen.tokens) >= leave:
                        seen.left_early = True
                        break
            finally:
                seen.note_stream_state()  # before leaving the block closes it (a crash cancels the client too)
    except EngineOverloaded:
        seen.rejected = True
    except EngineError as exc:
        seen.error = exc


async def _cancel(engine: Engine, cancel: Cancel) -> None:
    await trio.sleep_until(cancel.at)
    await engine.cancel(cancel.rid)


async def _main(script: Script, config: EngineConfig, monitor: Monitor) -> None:
    subs = [a for a in script.actions if isinstance(a, Submit)]
    leaves = {a.rid: a.after_tokens for a in script.actions if isinstance(a, Disconnect)}
    bound = time_bound(script)
    try:
        with trio.move_on_after(bound + 60.0) as outer:
            async with Engine.open(config) as engine:
                rt = engine.runtime
                with trio.move_on_after(bound) as scope:
                    async with trio.open_nursery() as nursery:
                        for sub in subs:
                            nursery.start_soon(_client, engine, sub, leaves.get(sub.rid), monitor.seen[sub.rid],
                                               monitor)
                        for action in script.actions:
                            if isinstance(action, Cancel):
                                nursery.start_soon(_cancel, engine, action)
                    await engine.drain()
                if scope.cancelled_caught:
                    monitor.fail("liveness", f"requests {sorted(rt.live)} still open {bound:.2f} s (virtual) "
                                 "after the start; every one should have ended by then")
                else:
                    s = script.setup
                    await trio.sleep(0.2 + 4 * s.report_delay + 10 * s.io_delay + 4 * s.step_time)
                    if rt.fatal is None:
                        monitor.check_end_state(engine)
        if outer.cancelled_caught:
            monitor.fail("liveness", "the engine did not shut down (a hang)")
    except EngineError as exc:
        monitor.fatal = exc
    monitor.virtual_s = trio.current_time()


def run_script(script: Script, strategy: str, log_path: Path, *, verify_replay: bool = True) -> RunResult:
    """Run one script on the engine as currently built (a variant, if one is enabled) and check it."""
    if log_path.exists():
        log_path.unlink()
    monitor = monitor_for(script)
    config = engine_config(script, log_path)
    with deterministic_trio(script.seed, strategy), instrumented(script, monitor):
        trio.run(_main, script, config, monitor, clock=trio.testing.MockClock(autojump_threshold=0))
    monitor.check_fatal()
    if log_path.exists():
        check_log(monitor, log_path, verify_replay=verify_replay)
    elif monitor.violation is None:
        monitor.fail("log", "no log was written")
    fatal = str(monitor.fatal) if monitor.fatal is not None else None
    return RunResult(script, strategy, log_path, monitor.violation, monitor.ticks, monitor.virtual_s, fatal)


# -- exploring -----------------------------------------------------------------------------------------------------
@attrs.define
class Found:
    """A violation, shrunk: the seed's script kept to ``keep`` (indices into ``make_script(seed, faults).actions``)
    still violates with the same kind."""

    seed: int
    strategy: str
    faults: bool
    variant: str | None
    violation: Violation
    """The shrunk run's violation."""
    original: Violation
    actions: int
    """Actions in the seed's whole script."""
    keep: list[int]
    shrink_runs: int
    shrink_s: float
    log: Path | None = None
    """The shrunk run's log, when written to an output directory."""

    @property
    def token(self) -> str:
        return encode_token(Token(LEVEL, self.seed, self.strategy, self.faults, self.variant, self.keep))

    def script(self) -> Script:
        return make_script(self.seed, self.faults).subset(self.keep)

    def regression_test(self) -> str:
        return regression_test(self)


@attrs.define
class Exploration:
    seeds: int
    elapsed_s: float
    found: Found | None

    def summary(self) -> str:
        rate = self.seeds / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (f"explored {self.seeds} seeds ({LEVEL}) in {self.elapsed_s:.1f} s: {rate:.1f} seeds/s, "
                f"{int(self.found is not None)} violations")


def explore(seeds: Sequence[int], strategy: str = "random", faults: bool = False, variant: str | None = None, *,
            shrink: bool = True, out: Path | None = None,
            progress: Callable[[int, RunResult], None] | None = None) -> Exploration:
    """Run the seeds in order under ``variant`` (None: the real code), stop at the first violation and shrink it.

    ``elapsed_s`` counts the seeds' runs only, not the shrinking. With ``out``, the shrunk run's log is kept there.
    """
    with tempfile.TemporaryDirectory(prefix="tickloom-explore-") as work, enabled(variant):
        log = Path(work) / "run.tlog"
        started = time.perf_counter()
        ran = 0
        for seed in seeds:
            result = run_script(make_script(seed, faults), strategy, log)
            ran += 1
            if progress is not None:
                progress(seed, result)
            if result.violation is not None:
                elapsed = time.perf_counter() - started
                found = shrink_violation(seed, strategy, faults, variant, result.violation, log, shrink=shrink)
                if out is not None:
                    found.log = keep_log(found, log, out)
                return Exploration(ran, elapsed, found)
        return Exploration(ran, time.perf_counter() - started, None)


def shrink_violation(seed: int, strategy: str, faults: bool, variant: str | None, violation: Violation,
                     log: Path, *, shrink: bool = True) -> Found:
    """Delta-debug the seed's actions down to a 1-minimal subset that still violates with the same kind."""
    script = make_script(seed, faults)
    runs = 0
    started = time.perf_counter()
    last: dict[tuple[int, ...], Violation | None] = {}

    def violates(keep: list[int]) -> bool:
        nonlocal runs
        key = tuple(keep)
        if key not in last:
            runs += 1
            result = run_script(script.subset(keep), strategy, log, verify_replay=violation.kind == "replay")
            last[key] = result.violation
        got = last[key]
        return got is not None and got.kind == violation.kind

    keep = list(range(len(script.actions)))
    if shrink:
        keep = ddmin(keep, violates)
    shrunk = last.get(tuple(keep), violation) if shrink else violation
    assert shrunk is not None
    return Found(seed, strategy, faults, variant, shrunk, violation, len(script.actions), keep, runs,
                 time.perf_counter() - started)


def keep_log(found: Found, log: Path, out: Path) -> Path:
    """Re-run the shrunk script and keep its log in ``out`` (for ``tickloom replay --bisect``)."""
    out.mkdir(parents=True, exist_ok=True)
    result = run_script(found.script(), found.strategy, log)
    target = out / f"explore-{LEVEL}-seed{found.seed}.tlog"
    n = 0
    while target.exists() or target.is_symlink():  # never overwrite
        n += 1
        target = out / f"explore-{LEVEL}-seed{found.seed}-{n}.tlog"
    log.replace(target)
    if result.violation is None or result.violation.kind != found.violation.kind:
        raise RuntimeError(f"seed {found.seed}: the shrunk script did not violate again on re-run "
                           f"({result.violation}); the explorer is not deterministic")
    return target


# -- replay tokens and regression tests ----------------------------------------------------------------------------
TOKEN_PREFIX = "tlx1-"


class Token(msgspec.Struct, frozen=True, array_like=True):
    """What ``tickloom explore --replay`` needs to re-run a violation."""

    level: str
    seed: int
    strategy: str
    faults: bool
    variant: str | None
    keep: list[int] | None
    """Indices of the kept actions; None keeps all."""


def encode_token(token: Token) -> str:
    return TOKEN_PREFIX + base64.urlsafe_b64encode(msgspec.json.encode(token)).decode().rstrip("=")


def decode_token(text: str) -> Token:
    """Raises ``ValueError`` for anything that is not a token ``encode_token`` wrote."""
    if not text.startswith(TOKEN_PREFIX):
        raise ValueError(f"a replay token starts with {TOKEN_PREFIX!r}")
    body = text[len(TOKEN_PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        token = msgspec.json.decode(raw, type=Token)
    except (binascii.Error, msgspec.DecodeError) as exc:
        raise ValueError(f"not a replay token: {exc}") from None
    if token.strategy not in STRATEGIES:
        raise ValueError(f"token strategy {token.strategy!r} is not one of {', '.join(STRATEGIES)}")
    return token


def replay_scenario(seed: int, strategy: str, faults: bool, keep: Sequence[int] | None = None) -> Violation | None:
    """Run one seed's script (kept to ``keep``) on the code as built now; its violation, or None."""
    script = make_script(seed, faults)
    if keep is not None:
        if any(not 0 <= i < len(script.actions) for i in keep):
            raise ValueError(f"seed {seed} has {len(script.actions)} actions; cannot keep {list(keep)}")
        script = script.subset(keep)
    with tempfile.TemporaryDirectory(prefix="tickloom-explore-") as work:
        return run_script(script, strategy, Path(work) / "run.tlog").violation


def regression_test(found: Found) -> str:
    """A pytest test (source text) that fails while the violation is present and passes once it is fixed."""
    detail = textwrap.wrap(" ".join(str(found.violation).split()), 110)
    lines = [f"    # {line}" for line in detail[:4]]
    lines.append(f"    # the shrunk script ({len(found.keep)} of {found.actions} actions):")
    lines += [f"    #   {action!r}"[:118] for action in found.script().actions]
    replay = f"    # re-run: tickloom explore --replay {found.token}"
    lines.append(replay if len(replay) <= 120 else replay + "  # noqa: E501")
    variant = f", variant {found.variant}" if found.variant else ""
    body = "\n".join(lines)
    return f'''def test_explore_{LEVEL}_seed_{found.seed}_{found.strategy}() -> None:
    """Found by the race explorer ({LEVEL} level, seed {found.seed}, strategy {found.strategy}{variant})."""
{body}
    from tickloom.tools.explore_actors import replay_scenario

    violation = replay_scenario({found.seed}, {found.strategy!r}, {found.faults}, {found.keep!r})
    assert violation is None, str(violation)
'''


def describe(found: Found) -> str:
    """The report printed for a violation."""
    lines = [
        f"VIOLATION at seed {found.seed} ({LEVEL}, strategy {found.strategy}, faults {'on' if found.faults else 'off'}"
        f"{', variant ' + found.variant if found.variant else ''}): {found.original}",
        f"shrunk from {found.actions} to {len(found.keep)} actions in {found.shrink_runs} runs "
        f"({found.shrink_s:.1f} s): {found.violation}",
    ]
    lines += [f"  {action!r}" for action in found.script().actions]
    if found.log is not None:
        lines.append(f"log: {found.log}  (tickloom replay --bisect {found.log})")
    else:
        lines.append("log: not kept (pass --out DIR to keep the failing run's log)")
    lines.append(f"replay: tickloom explore --replay {found.token}")
    lines.append("regression test (pytest):")
    lines.append(found.regression_test())
    return "\n".join(lines)
