"""What-if runs: re-simulate a log's requests under another core configuration (``tickloom whatif``).

The real ``SchedulerCore``, built with the what-if configuration, is driven by the simulator (``replay/sim.py``).
Everything around it comes from the log:

- **Client inputs.** Arrivals (with their deadlines, which are absolute times on the log's clock), cancellations and
  clients gone are delivered at the ``now_ns`` of the tick the log had them in. The simulated clock is the log's
  clock, so no time is shifted. A ``Shutdown`` that ended requests in the original is delivered at its logged time.
  One that ended none (a graceful close) is delivered once the what-if run has drained. Stop-string matches are
  mapped by output index: the retire actor reports ``StopMatched(r, k)`` once the what-if streams r's token k. This
  always maps, because the tokens up to k are the logged ones.
- **Tokens.** ``LoggedTokenDevice`` answers output index k of a request with the token the log committed at index k
  (the ``EmitTokens`` commands: what the client received, and the logprob if it travelled). So EOS and stop
  positions are reproduced. An index the log never committed falls back to the oracle
  (``replay/oracle.py``, which never emits EOS). This happens when a request the original cut short (a timeout, a
  cancel, an error) runs further. ``WhatIfResult.oracle_tokens`` counts these tokens, and the report names them.
- **Timing: two modes.**

  *replayed*: the configuration is the log's own, and ``modelled`` is not asked for. Every completion is delivered
  at the tick the log had it (``ReplayTiming``): the device completes as many steps in tick t as the log delivered
  results in tick t+1; each spill, prefetch and stop report gets the logged delay, and each fault the logged
  answer; a deadline fires in the tick the log has its ``DeadlineReached``; and each tick runs at the logged
  ``now_ns``. The inputs the simulated actors produce for a tick (step results with the device's tokens, spill and
  swap-in answers, stop matches, deadline reports) must be the log's: the same kinds, about the same requests and
  steps, with the same tokens (a row the log never committed, such as an over-run or a poisoned row's placeholder,
  takes the logged result's token). Only then does the tick run, in the log's input order and with the log's payloads
  (error texts, byte counts, measured step times). Any mismatch, and any digest that differs from the logged one, is
  reported as a divergence. So the what-if degenerates to exact replay, and it checks its own token device, stop
  mapping and actors against the log.

  *modelled*: the configuration changed, so the logged delivery ticks no longer apply. Step times come from a
  ``StepModel`` (``replay/step_model.py``: non-negative costs per step, per prefill token, per decode row and per
  position of context read, plus the median overhead the core waited beyond a measured step). For a stub log it is
  the stub's fixed step time, exact; otherwise the fit of the log's measured steps, or the model's calibration
  profile when the log's steps do not span the what-if's (``replay/whatif_model.py`` chooses, and says why). The
  what-if's steps outside the chosen model's range are counted and reported as an extrapolation. The run is
  repeated ``DRAWS`` times with each step's time scaled by one of the model's residual ratios; the spread of each
  figure over them is its interval. The device is one FIFO. A step starts when it is dispatched or when the device
  frees up, whichever is later, and runs for the modelled time (``ModelTiming``). The next tick comes at the
  earliest of: the next step's end, the next client input, the next watched deadline. It comes at once (same
  ``now_ns``) when the core asks for a tick, a completion is due, or a spill copy sits at the head of the device's
  queue. Beyond the step-time model, the approximations are these: spill copies, swap-ins and the retire actor's
  reports take no time; and faults are not carried over (the what-if's device, spill store and swap-in never fail;
  the report says how many the log had). ``modelled=True`` forces this mode with the log's own configuration, to
  see how well the model fits.

``measure`` computes the same metrics from any run's ``(TickInputs, TickOutputs)``: the original column comes from
the log itself, and the what-if column from the simulator's ticks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import Counter
from typing import Literal

import attrs
import msgspec

from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.events import (
    NO_SAMPLE,
    Input,
    PrefetchSpill,
    RunStep,
    SpillDone,
    SpillOut,
    StepDone,
    StepFailed,
    SwapInFailed,
    SwapInReady,
    TickInputs,
    TickOutputs,
)
from tickloom.replay.oracle import OracleExecutor
from tickloom.replay.policy import Completion, Key, Policy
from tickloom.replay.sim import Simulator
from tickloom.replay.step_model import StepModel
from tickloom.replay.whatif_log import CLIENT_INPUTS, LoggedRun, read_log
from tickloom.replay.whatif_measure import RunMetrics, Tick, intervals, measure
from tickloom.replay.whatif_model import (
    DRAWS,
    DrawnModel,
    Extrapolation,
    LogSetting,
    ModelChoice,
    StepClock,
    log_model,
    run_on_chosen_model,
    sim_steps,
)

NEVER = 1 << 40
"""The delay of a completion the log never delivered: past the end of any log."""
Mode = Literal["replayed", "modelled"]
__all__ = ["LoggedRun", "LoggedTokenDevice", "ModelTiming", "WhatIfResult", "read_log", "whatif"]


class WhatIfDivergence(Exception):
    """A replayed what-if produced inputs that differ from the log's at ``tick``."""

    def __init__(self, tick: int, message: str) -> None:
        super().__init__(f"tick {tick}: {message}")
        self.tick = tick


# -- the simulated actors -------------------------------------------------------------------------------------
@attrs.define(slots=True, eq=False)
class LoggedTokenDevice(OracleExecutor):
    """The oracle device, but output index k of a request is the token the log committed there (see the module
    docstring). ``step_rows`` (replayed mode): an uncommitted row takes the logged step result's token."""

    logged: dict[str, dict[int, int]] = attrs.Factory(dict)
    logged_logprobs: dict[str, dict[int, float]] = attrs.Factory(dict)
    step_rows: dict[tuple[int, str], int] = attrs.Factory(dict)
    model: StepClock | None = None
    current_step: int = attrs.field(default=-1, init=False)

    def token(self, request_id: str, index: int) -> int:
        logged = self.logged.get(request_id)
        if logged is not None and index in logged:
            return logged[index]
        row = self.step_rows.get((self.current_step, request_id))
        return row if row is not None else OracleExecutor.token(self, request_id, index)

    def run_step(self, step: RunStep) -> StepDone | StepFailed:
        self.current_step = step.step_id
        result = OracleExecutor.run_step(self, step)
        if not isinstance(result, StepDone):
            return result
        logprobs: list[float] | None = None
        if self.logged_logprobs:
            found = [self.logged_logprobs.get(r, {}).get(k)
                     for r, k in zip(step.request_ids, step.sample_indices, strict=True) if k != NO_SAMPLE]
            if any(v is not None for v in found):
                logprobs = [math.nan if v is None else v for v in found]
        step_time = self.model.predict(step) if self.model is not None else result.step_time_ns
        return msgspec.structs.replace(result, step_time_ns=step_time, logprobs=logprobs)


@dataclasses.dataclass(slots=True, kw_only=True)
class ReplayTiming(Policy):
    """Replayed mode: every timing and fault answer is the log's (see the module docstring)."""

    run: LoggedRun
    tick: int = 0
    """The tick being simulated (set by the driver before each tick)."""
    asked: Counter[Key] = dataclasses.field(default_factory=Counter)

    def device_steps(self, tick: int) -> int:
        return self.run.results_at.get(tick + 1, 0)

    def spill_ok(self, command: SpillOut) -> bool:
        answers = self.run.spill_ok.get(command.request_id, [])
        n = self._count(("spill", command.request_id))
        return answers[n] if n < len(answers) else True

    def swap_in(self, command: PrefetchSpill) -> bool | None:
        answers = self.run.swap_in_ok.get(command.request_id, [])
        n = self._count(("swap_in", command.request_id))
        return answers[n] if n < len(answers) else None  # the log ends before the answer: none

    def delay(self, completion: Completion) -> int:
        at = self.run.delivered.get(completion.key)
        return NEVER if at is None else max(0, at - completion.caused_at - 1)

    def deadline_due(self, request_id: str, deadline_ns: int, now_ns: int) -> bool:
        return (self.tick, request_id) in self.run.deadlines

    def _count(self, key: Key) -> int:
        n = self.asked[key]
        self.asked[key] = n + 1
        return n


@dataclasses.dataclass(slots=True, kw_only=True)
class ModelTiming(Policy):
    """Modelled mode: the device runs its FIFO back to back with modelled step times; each tick comes at the next
    event (see the module docstring). The driver sets ``sim`` and, before each tick, ``next_client_ns``."""

    model: StepClock
    sim: Simulator | None = None
    next_client_ns: int | None = None
    busy_until: int = 0
    ends: dict[int, int] = dataclasses.field(default_factory=dict)
    next_ns: int = 0
    """When the next tick runs (decided in this tick, once the commands are dispatched)."""

    def device_steps(self, tick: int) -> int:
        sim = self.sim
        assert sim is not None
        now = sim.now_ns
        first_end: int | None = None
        copy_first = False
        for _, command in sim.queue:
            if isinstance(command, RunStep):
                end = self.ends.get(command.step_id)
                if end is None:
                    end = max(now, self.busy_until) + self.model.predict(command)
                    self.ends[command.step_id] = self.busy_until = end
                if first_end is None:
                    first_end = end
            elif isinstance(command, SpillOut) and first_end is None:
                copy_first = True
        events = [t for t in (first_end, self.next_client_ns,
                              min(sim.deadlines.watched.values(), default=None)) if t is not None]
        immediate = sim.needs_tick or bool(sim.schedule) or copy_first or not events
        self.next_ns = now if immediate else max(now, min(events))
        return 1 if first_end is not None and first_end <= self.next_ns else 0


class LogOrderSimulator(Simulator):
    """The simulator, but a tick runs on ``expected`` (the logged inputs) once the simulated actors produced the
    same inputs (see ``input_key``); raises ``WhatIfDivergence`` otherwise."""

    expected: TickInputs | None = None

    def run_core(self, inputs: list[Input]) -> tuple[TickInputs, TickOutputs]:
        expected = self.expected
        if expected is None:
            return super().run_core(inputs)
        got, want = Counter(map(input_key, inputs)), Counter(map(input_key, expected.inputs))
        if got != want:
            raise WhatIfDivergence(self.tick, f"the simulated actors delivered {_keys(got - want)} where the log "
                                              f"has {_keys(want - got)}")
        return expected, self.core.tick(expected)


def input_key(msg: Input) -> tuple[object, ...]:
    """What must match between a simulated input and the logged one: not error texts, byte counts or times."""
    name = type(msg).__name__
    if isinstance(msg, StepDone):
        return (name, msg.step_id, tuple(msg.request_ids), tuple(msg.token_ids))
    if isinstance(msg, StepFailed):
        return (name, msg.step_id)
    if isinstance(msg, SpillDone):
        return (name, msg.request_id, msg.ok)
    if isinstance(msg, SwapInReady | SwapInFailed):
        return (name, msg.request_id)
    return (name, msgspec.msgpack.encode(msg))


def _keys(keys: Counter[tuple[object, ...]]) -> str:
    shown = [" ".join(str(part) if not isinstance(part, bytes) else "" for part in key).strip() for key in keys]
    return "[" + ", ".join(sorted(shown)) + "]" if shown else "nothing"


# -- the what-if ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class WhatIfResult:
    path: str
    mode: Mode
    base: CoreConfig
    config: CoreConfig
    changes: dict[str, tuple[object, object]]
    model: StepModel
    """The step-time model the what-if ran on (``model.source`` and ``model.why`` say which, and why)."""
    original: RunMetrics
    whatif: RunMetrics
    ticks: int
    oracle_tokens: dict[str, int]
    """request -> tokens the what-if's client received that the log never had (from the oracle)."""
    notes: list[str]
    divergence: str | None = None
    """Replayed mode: where the re-simulation parted from the log (None: identical decisions)."""
    run_ticks: list[Tick] = dataclasses.field(default_factory=list, repr=False)
    """The what-if's own ticks (inputs and outputs), as its core saw and decided them."""
    intervals: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """Modelled mode: figure (``whatif_measure.FIGURES``) -> its (low, high) over the residual draws."""
    extrapolation: Extrapolation | None = None
    """Modelled mode: the what-if's steps outside the model's range."""

    @property
    def extrapolated(self) -> bool:
        return self.extrapolation is not None and self.extrapolation.marked

    def to_json(self) -> dict[str, object]:
        return {
            "log": self.path, "mode": self.mode, "ticks": self.ticks,
            "set": {k: {"was": was, "now": now} for k, (was, now) in self.changes.items()},
            "config": json.loads(self.config.to_json()),
            "step_model": self.model.to_json(), "extrapolated": self.extrapolated,
            "extrapolation": None if self.extrapolation is None else self.extrapolation.to_json(),
            "original": self.original.summary(), "whatif": self.whatif.summary(),
            "intervals": {k: list(v) for k, v in self.intervals.items()},
            "oracle_tokens": self.oracle_tokens, "notes": self.notes, "divergence": self.divergence,
        }


def whatif(path: str | os.PathLike[str], config: CoreConfig | None = None, *, modelled: bool = False,
           run: LoggedRun | None = None, max_ticks: int | None = None, step_model: ModelChoice = "auto",
           draws: int = DRAWS, speed: float = 1.0) -> WhatIfResult:
    """Re-simulate the log at ``path`` (or its already read ``run``) under ``config`` (default: the log's own).

    ``step_model``: ``auto`` chooses (``whatif_model.choose``), ``log`` keeps the log's own model, ``calibration``
    takes the stored calibration profile (``ValueError`` if there is none). ``draws``: the residual draws the
    intervals come from (0: none). ``speed`` (modelled mode): every modelled step time times this, for a host that
    runs the steps that much slower than the log's did (``--validate`` sets it from the CPU share each real run had).
    Raises ``LogError`` / ``ReplayConfigError`` for an unreadable log.
    """
    run = run or read_log(path)
    config = config or run.config
    changes = {f: (getattr(run.config, f), getattr(config, f)) for f in CoreConfig.__struct_fields__
               if getattr(run.config, f) != getattr(config, f)}
    setting = run.setting or LogSetting(None, None, "", "", "", 0)
    model = log_model(setting, run.samples, run.latencies)
    mode: Mode = "modelled" if changes or modelled else "replayed"
    notes: list[str] = []
    divergence = None
    spread: dict[str, tuple[float, float]] = {}
    extrapolation: Extrapolation | None = None
    sim: Simulator
    if mode == "replayed":
        sim, divergence = _replayed(run)
        ticks = len(sim.outputs)
        outcome = f"diverged at {divergence}" if divergence else f"decisions identical to the log's in {ticks} ticks"
        notes.append(f"replayed: the configuration is the log's, every completion comes at its logged tick: {outcome}")
    else:
        limit = max_ticks or max(100_000, 50 * len(run.ticks))
        sim, model, extrapolation = run_on_chosen_model(
            lambda clock: _modelled(run, config, clock, limit), sim_steps, setting, model, run.samples, step_model,
            speed)
        ticks = len(sim.outputs)
        notes.append(f"modelled: {model.describe()}; spill copies, swap-ins and reports take no time")
        notes.append(f"step model: {model.source}: {model.why}")
        if extrapolation.outside:
            notes.append(extrapolation.describe(model))
        point = measure(zip(sim.inputs, sim.outputs, strict=True)).summary()
        if not model.ratios:  # the stub's clock is exact (and a log without measured steps has no residuals)
            spread = intervals(point, [])
            notes.append("intervals: none wider than the point (the model has no residuals"
                         + (": the stub's clock is exact)" if model.source == "stub" else ")"))
        elif draws:
            spread = intervals(point, [measure(zip(d.inputs, d.outputs, strict=True)).summary() for d in (
                _modelled(run, config, DrawnModel(model, k), limit) for k in range(draws))])
            notes.append(f"intervals: the least and most each figure came to over {draws} runs with every step's "
                         f"time scaled by one of the model's {len(model.ratios)} residual ratios "
                         f"({model.ratios[0]:.2f}-{model.ratios[-1]:.2f})")
        faults = [f"{what}: {n}" for n, what in ((len(run.failed_steps), "failed steps"),
                                                (sum(not ok for v in run.spill_ok.values() for ok in v),
                                                 "failed spills"),
                                                (sum(not ok for v in run.swap_in_ok.values() for ok in v),
                                                 "failed swap-ins")) if n]
        if faults:
            notes.append(f"not carried over: {', '.join(faults)} (the what-if's actors never fail)")
    original = measure(run.ticks)
    run_ticks = list(zip(sim.inputs, sim.outputs, strict=True))
    result = measure(run_ticks)
    oracle = {rid: n for rid, out in result.outputs.items()
              if (n := sum(k not in run.tokens.get(rid, {}) for k in range(len(out))))}
    for rid, n in oracle.items():
        reason = original.reasons.get(rid, "open")
        notes.append(f"{rid}: the log has {len(original.outputs.get(rid, []))} of its tokens (the original ended "
                     f"with {reason!r}); the {n} after them came from the oracle")
    return WhatIfResult(os.fspath(path), mode, run.config, config, changes, model, original, result, ticks,
                        oracle, notes, divergence, run_ticks, spread, extrapolation)


def _device(run: LoggedRun, config: CoreConfig, *, replayed: bool = False,
            model: StepClock | None = None) -> LoggedTokenDevice:
    avoid = tuple(config.eos_token_ids) + tuple(
        t for t in (config.think_start_token, config.think_end_token) if t is not None)
    return LoggedTokenDevice(config.vocab_size, avoid=avoid, logged=dict(run.tokens),
                             logged_logprobs=dict(run.logprobs), model=model,
                             step_rows=run.step_rows if replayed else {},
                             fail_steps=frozenset(run.failed_steps) if replayed else frozenset())


def _replayed(run: LoggedRun) -> tuple[LogOrderSimulator, str | None]:
    """Replayed mode: the log's ticks, each at its logged time, with the log's delivery timing."""
    device = _device(run, run.config, replayed=True)
    timing = ReplayTiming(run=run, spill_after_device=True)
    sim = LogOrderSimulator(SchedulerCore(run.config), device, timing, stop_at=dict(run.stops),
                            record_decisions=False)
    for inputs, logged in run.ticks:
        if inputs.tick != sim.tick:
            return sim, f"tick {sim.tick}: the log holds tick {inputs.tick} here"
        timing.tick = inputs.tick
        sim.expected = inputs
        sim.now_ns = inputs.now_ns
        try:
            out = sim.step(*(msg for msg in inputs.inputs if isinstance(msg, CLIENT_INPUTS)))
        except WhatIfDivergence as exc:
            return sim, str(exc)
        if out.digest != logged.digest:
            return sim, f"tick {inputs.tick}: the re-simulated decisions differ from the logged ones"
    return sim, None


def _modelled(run: LoggedRun, config: CoreConfig, model: StepClock, max_ticks: int) -> Simulator:
    """Modelled mode: client inputs at their logged times, steps at their modelled times, until drained."""
    timing = ModelTiming(model=model, spill_after_device=True, report_deadlines=True)
    sim = Simulator(SchedulerCore(config), _device(run, config, model=model), timing, stop_at=dict(run.stops),
                    record_decisions=False)
    timing.sim = sim
    clients = list(reversed(run.clients))
    shutdown = run.graceful_shutdown
    starts = [t for t, _ in run.clients] + [inputs.now_ns for inputs, _ in run.ticks[:1]]
    sim.now_ns = min(starts, default=0)
    for _ in range(max_ticks):
        due: list[Input] = []
        while clients and clients[-1][0] <= sim.now_ns:
            due.append(clients.pop()[1])
        timing.next_client_ns = clients[-1][0] if clients else None
        sim.step(*due)
        sim.now_ns = timing.next_ns
        if sim.busy or clients or sim.deadlines.watched:
            continue
        if shutdown is None:
            return sim
        clients.append((sim.now_ns, shutdown))
        shutdown = None
    raise RuntimeError(f"whatif: the modelled run is still busy after {max_ticks} ticks")
