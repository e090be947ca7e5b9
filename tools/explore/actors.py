"""The race explorer's actor level: the real trio actors and ``Engine`` on the stub device, under ``MockClock``.

One seed is one run, reproducible byte for byte:

* **The script** (``tools.explore.script``): the engine's setup and the clients' actions (submit, cancel, leave
  early, deadlines) and, with ``faults``, failed steps, spill writes and swap-in reads, an actor crash, jittered
  step times, slow copies and spill I/O, late retire reports; all drawn from one ``random.Random(seed)``.
* **The schedule** (``tools.explore.schedule``): trio's own deterministic-scheduling hook, seeded, with the
  ``random``, ``pct`` or ``delay`` policy; ``MockClock(autojump_threshold=0)`` makes time virtual. The hook is
  private: importing this module raises ``ImportError`` if the installed trio lacks it (``tickloom[explore]`` pins
  one that has it).
* **No other nondeterminism.** ``instrumented`` builds each engine with: spill I/O that the actors hand to threads
  (``trio.to_thread.run_sync``) run inline after a seeded virtual delay; the stub device's step times and copy
  latencies drawn from the seed; spill in the host tier only (no files). Request ids and sampling seeds come from
  the script; the log path is the same for every run of one work directory (the header records it). Nothing
  depends on ``PYTHONHASHSEED`` (a test runs one seed under two hash seeds).

The checks (``tools.explore.checks``): the core's invariants after every tick; at every delivery to the retire
actor, the delivering tick's frame is already in the file; one ending per request, in the log and on the client,
with no token after it; the client's tokens a prefix of the logged ones; finish reasons the script explains;
blocks, queues, submit slots, deadline watches, spilled copies and streams back to baseline; every request ended
within a virtual-time bound, with no tick storm; the log replays ``identical``. With a planned actor crash: the
engine fails with ``EngineError`` naming that actor, every stream still open has that error, nothing hangs.

The driver (``tools.explore.driver``) runs seeds through ``ACTORS``, shrinks a violation over the script's actions,
keeps its log, and describes it with a replay token and a pytest regression test. The broken variants the tests
find live in ``tools.explore.variants``.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import trio
import trio.testing

import tickloom.runtime as runtime_module
from tickloom import Engine, EngineConfig, EngineError, EngineOverloaded, SamplingParams
from tickloom.engine.core.errors import InvariantViolation
from tickloom.events import RunStep
from tickloom.replay.policy import Decision
from tickloom.tools.explore.checks import Monitor, Seen, check_actor_log
from tickloom.tools.explore.driver import Run, Schedule
from tickloom.tools.explore.schedule import deterministic_trio  # checks that trio has its hook
from tickloom.tools.explore.script import (
    Action,
    Cancel,
    Disconnect,
    Script,
    Submit,
    engine_config,
    make_script,
    monitor_for,
    time_bound,
)

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


def run_script(script: Script, strategy: str, log_path: Path, *, verify_replay: bool = True) -> Run:
    """Run one script on the engine as currently built (a variant, if one is enabled) and check it; the log is
    written at ``log_path`` (replacing the file there) and, with ``verify_replay``, must replay ``identical``."""
    if log_path.exists():
        log_path.unlink()
    monitor = monitor_for(script)
    config = engine_config(script, log_path)
    with deterministic_trio(script.seed, strategy), instrumented(script, monitor):
        trio.run(_main, script, config, monitor, clock=trio.testing.MockClock(autojump_threshold=0))
    monitor.check_fatal()
    if log_path.exists():
        check_actor_log(monitor, log_path, verify_replay=verify_replay)
    elif monitor.violation is None:
        monitor.fail("log", "no log was written")
    fatal = str(monitor.fatal) if monitor.fatal is not None else None
    return Run(monitor.violation, monitor.ticks, virtual_s=monitor.virtual_s, fatal=fatal)


# -- the level, as the driver calls it -------------------------------------------------------------------------------
class ActorLevel:
    """The actor level: ``tools.explore.driver.Level`` over ``Script``s. Its schedule is trio's, seeded by the seed
    and the strategy, so a re-run with a subset of the script kept runs under the same seed, and no run moves
    events; its engine writes every run's log, so every seed's is replayed."""

    name = LEVEL
    sample_every = 1
    moves_events = False
    ordered_actions = False

    def subject(self, seed: int, faults: bool, source: str | None) -> Script:
        if source is not None:
            raise ValueError("the actor level runs generated scripts; a log's workload is for the core level")
        return make_script(seed, faults)

    def run(self, subject: Script, schedule: Schedule, log: Path, *, check_replay: bool) -> Run:
        return run_script(subject, schedule.strategy, log, verify_replay=check_replay)

    def rerun(self, subject: Script, schedule: Schedule, edits: Sequence[Decision], log: Path, *,
              check_replay: bool) -> Run:
        if edits:
            raise ValueError("the actor level moves no events")
        return run_script(subject, schedule.strategy, log, verify_replay=check_replay)

    def check_kept_log(self, path: Path, kind: str) -> str:
        return ""

    def describe_action(self, action: Action) -> str:
        return repr(action)

    def describe_edit(self, edit: Decision) -> str:
        return repr(edit)


ACTORS = ActorLevel()
"""The actor level."""
