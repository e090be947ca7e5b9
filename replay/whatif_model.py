"""Which step-time model a what-if runs on, how far its steps leave the model's range, and the residual draws.

``log_model`` is the model a log gives by itself: the stub's exact clock for a stub log, else the fit of the log's
measured steps (``replay/step_model.py``). ``stored_profile`` is the calibration profile of the log's model and
setting, if ``tickloom bench calibrate`` stored one, scaled to the speed the log's steps ran at. ``choose`` picks
between them once the what-if has run on the log's model: the log's own fit when its steps span the what-if's
(``coverage``: at least ``SPAN`` of the what-if's steps fall in a cell of shapes where the log has steps of its
own; a range alone is not enough, as a log whose steps all have four rows says little about one row, though one
row lies in its range), otherwise the profile. The reason is kept in ``StepModel.why`` and printed.

``Extrapolation`` counts the what-if's steps outside the chosen model's range, per dimension: their times are the
model's guess, and the output says so.

``DrawnModel`` is the model with each step's time multiplied by one of its residual ratios (measured / modelled),
picked by a hash of the step and the draw, so every run is reproducible and the device and the clock see the same
time for a step. The what-if re-runs with ``DRAWS`` of them; the spread of each figure is its interval.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol, TypeVar

from tickloom.events import LogHeader, RunStep
from tickloom.replay.sim import Simulator
from tickloom.replay.step_model import (
    DIMENSIONS,
    StepModel,
    StepSample,
    StepShape,
    fit_step_model,
    load_profile,
    rescaled,
    stub_model,
)

ModelChoice = Literal["auto", "log", "calibration"]
R = TypeVar("R")
DRAWS = 8
SPAN = 0.9
"""The log's own fit is kept when at least this share of the what-if's steps is covered by the log's steps."""
COVER_SAMPLES = 3
MARGINAL = 0.02
"""A what-if with at most this share of its steps outside its model's range is not marked as an extrapolation
(the few are still counted in a note): a run that moves a little can step just past the edge."""
MIN_LOG_SAMPLES = 8
"""Fewer measured steps than this do not make a fit the what-if prefers over a profile."""


class StepClock(Protocol):
    def predict(self, step: RunStep) -> int: ...


@dataclasses.dataclass(frozen=True, slots=True)
class DrawnModel:
    """``base`` with each step's time scaled by a residual ratio drawn for (``draw``, step id)."""

    base: StepModel
    draw: int

    def predict(self, step: RunStep) -> int:
        ratios = self.base.ratios
        time = self.base.predict(step)
        if not ratios:
            return time
        h = ((step.step_id + 1) * 0x9E3779B1 + (self.draw + 1) * 0x85EBCA77) & 0xFFFFFFFF
        h ^= h >> 15
        h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
        h ^= h >> 12
        return max(1, round(time * ratios[h % len(ratios)]))


@dataclasses.dataclass(frozen=True, slots=True)
class LogSetting:
    """What a log's header says about the model that wrote it."""

    model: str | None
    """The engine configuration's ``model`` (None: a core-level log, with no engine configuration)."""
    stub_step_time: float | None
    fingerprint: str
    device: str
    dtype: str
    threads: int

    @classmethod
    def of(cls, header: LogHeader) -> LogSetting:
        engine: Any = None
        try:
            data = json.loads(header.config_json)
            engine = data.get("engine") if isinstance(data, dict) else None
        except (json.JSONDecodeError, RecursionError):
            engine = None
        model = engine.get("model") if isinstance(engine, dict) else None
        step = engine.get("stub_step_time") if isinstance(engine, dict) else None
        return cls(model if isinstance(model, str) else None,
                   float(step) if isinstance(step, int | float) else None,
                   header.model_fingerprint, header.device, header.dtype, header.threads)

    @property
    def is_stub(self) -> bool:
        return self.model == "stub" and self.stub_step_time is not None


def log_model(setting: LogSetting, samples: list[StepSample], latencies: list[int]) -> StepModel:
    """The model a log gives by itself (see the module docstring)."""
    if setting.is_stub:
        assert setting.stub_step_time is not None
        return stub_model(setting.stub_step_time)
    model = fit_step_model(samples, latencies=latencies)
    return dataclasses.replace(model, why="fitted on the log's own steps")


def stored_profile(setting: LogSetting, samples: list[StepSample], overhead_ns: float) -> StepModel | None:
    """The calibration profile's model for the log's model and setting, scaled to the log's measured ``samples``
    (``step_model.rescaled``) and with the log's overhead; None without a profile."""
    if setting.is_stub or not setting.fingerprint:
        return None
    found = load_profile(setting.fingerprint, setting.device, setting.dtype, setting.threads)
    if found is None:
        return None
    profile, path = found
    model, scale = rescaled(dataclasses.replace(profile.fit(path), overhead_ns=overhead_ns), samples)
    return dataclasses.replace(model, why=f"scaled by {scale:.2f}, the median of the log's measured / profiled "
                                          "step times")


def shape_bin(shape: StepShape) -> tuple[int, int, int]:
    """A shape's cell for ``coverage``: decode rows by half octaves, prefill tokens and context by octaves."""
    def octave(x: int, per: int) -> int:
        return 0 if x <= 0 else 1 + int(per * math.log2(x))
    return (octave(shape.prefill_tokens, 1), octave(shape.decode_rows, 2), octave(shape.context, 1))


def coverage(samples: Iterable[StepSample], steps: Iterable[RunStep]) -> float:
    """The fraction of ``steps`` whose ``shape_bin`` holds at least ``COVER_SAMPLES`` of the log's measured
    ``samples``: how much of the what-if the log's own steps can speak for (1.0 for no step)."""
    seen = Counter(shape_bin(s.shape) for s in samples if s.step_time_ns > 0)
    bins = [shape_bin(StepShape.of(step)) for step in steps]
    return sum(seen[b] >= COVER_SAMPLES for b in bins) / len(bins) if bins else 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class Extrapolation:
    """How many of a run's steps leave its model's range, and in which dimension."""

    steps: int
    outside: int
    by_dimension: dict[str, int]

    @classmethod
    def of(cls, model: StepModel, steps: Iterable[RunStep]) -> Extrapolation:
        total = outside = 0
        by: Counter[str] = Counter()
        for step in steps:
            total += 1
            dims = model.outside(StepShape.of(step))
            outside += bool(dims)
            by.update(dims)
        return cls(total, outside, {d: by[d] for d in DIMENSIONS if by[d]})

    @property
    def fraction(self) -> float:
        return self.outside / self.steps if self.steps else 0.0

    @property
    def marked(self) -> bool:
        """Whether the prediction is an extrapolation: more than ``MARGINAL`` of its steps outside the range."""
        return self.fraction > MARGINAL

    def describe(self, model: StepModel) -> str:
        dims = ", ".join(f"{d.replace('_', ' ')}: {n}" for d, n in self.by_dimension.items())
        if not self.marked:
            return (f"{self.outside} of the what-if's {self.steps} steps ({self.fraction:.0%}) lie just outside the "
                    f"step model's range ({model.describe_range()}): too few to mark the prediction")
        return (f"EXTRAPOLATION: {self.outside} of the what-if's {self.steps} steps ({self.fraction:.0%}) lie outside "
                f"the range the step model is valid for ({model.describe_range()}; outside in {dims}): their "
                f"times, and the figures that depend on them, are a guess")

    def to_json(self) -> dict[str, object]:
        return {"steps": self.steps, "outside": self.outside, "by_dimension": self.by_dimension}


def choose(fitted: StepModel, profile: StepModel | None, covered: float) -> StepModel:
    """The model the what-if keeps, with its reason: ``fitted`` (the log's own) when the log's steps cover at least
    ``SPAN`` of the what-if's (``coverage``), else ``profile`` when there is one."""
    if fitted.source == "stub":
        return fitted
    share = f"{covered:.0%} of the what-if's steps have {COVER_SAMPLES} or more of the log's steps of their shape"
    if fitted.source == "log" and fitted.samples >= MIN_LOG_SAMPLES and covered >= SPAN:
        return dataclasses.replace(fitted, why=f"fitted on the log's own steps: {share}")
    if profile is None:
        missing = "no calibration profile is stored for this model and setting (`tickloom bench calibrate` makes one)"
        if fitted.source != "log":
            return dataclasses.replace(fitted, why=f"the log has no measured step times, and {missing}")
        return dataclasses.replace(fitted, why=f"fitted on the log's own {fitted.samples} steps, though only {share}; "
                                               f"{missing}")
    if fitted.source != "log":
        return dataclasses.replace(profile, why="the calibration profile: the log has no measured step times")
    return dataclasses.replace(profile, why=f"the calibration profile, {profile.why}: only {share}")


def run_on_chosen_model(simulate: Callable[[StepClock], R], steps_of: Callable[[R], list[RunStep]],
                        setting: LogSetting, fitted: StepModel, samples: list[StepSample],
                        choice: ModelChoice, speed: float = 1.0) -> tuple[R, StepModel, Extrapolation]:
    """The modelled run (``simulate``; ``steps_of`` its steps) on the model ``choice`` names (``auto``: ``choose``'s;
    the run on the log's own model comes first, and tells how much of the what-if the log covers), that model, and
    the run's extrapolation on it. ``calibration`` without a stored profile raises ``ValueError``. ``speed``: every
    step time of the chosen model times this (a host slower or faster than the log's by that factor; 1: as logged).
    """
    profile = None if choice == "log" else stored_profile(setting, samples, fitted.overhead_ns)
    if speed != 1.0:
        note = f"; times x{speed:.3f} for the host's speed"
        fitted = dataclasses.replace(fitted.scaled(speed), why=fitted.why + note)
        if profile is not None:
            profile = dataclasses.replace(profile.scaled(speed), why=profile.why + note)
    if choice == "calibration":
        if profile is None:
            raise ValueError("no calibration profile is stored for this log's model and setting "
                             "(`tickloom bench calibrate` makes one)")
        profile = dataclasses.replace(profile, why=f"asked for (--step-model calibration), {profile.why}")
        run = simulate(profile)
        return run, profile, Extrapolation.of(profile, steps_of(run))
    run = simulate(fitted)
    model = choose(fitted, profile, coverage(samples, steps_of(run)))
    if model.source == "calibration":
        run = simulate(model)
    return run, model, Extrapolation.of(model, steps_of(run))


def sim_steps(sim: Simulator) -> list[RunStep]:
    """Every step a simulated run dispatched."""
    return [c for out in sim.outputs for c in out.commands if isinstance(c, RunStep)]
