"""Which step-time model a what-if runs on, how far its steps leave the model's range, and the residual draws.

``log_model`` is the model a log gives by itself: the stub's exact clock for a stub log, else the fit of the log's
measured steps (``replay/step_model.py``). ``stored_profile`` is the calibration profile of the log's model and
setting on this machine, if ``tickloom bench calibrate`` stored one. ``choose`` picks between them once the what-if
has run on the log's model: the log's own fit when its steps span the what-if's (at most ``SPAN_TOLERANCE`` of
the what-if's steps outside its range), otherwise the profile when it covers more of them. The reason is kept in
``StepModel.why`` and printed.

``Extrapolation`` counts the what-if's steps outside the chosen model's range, per dimension: their times are the
model's guess, and the output says so.

``DrawnModel`` is the model with each step's time multiplied by one of its residual ratios (measured / modelled),
picked by a hash of the step and the draw, so every run is reproducible and the device and the clock see the same
time for a step. The what-if re-runs with ``DRAWS`` of them; the spread of each figure is its interval.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol

from tickloom.events import LogHeader, RunStep
from tickloom.replay.sim import Simulator
from tickloom.replay.step_model import (
    DIMENSIONS,
    StepModel,
    StepSample,
    StepShape,
    fit_step_model,
    load_profile,
    stub_model,
)

ModelChoice = Literal["auto", "log", "calibration"]
DRAWS = 8
SPAN_TOLERANCE = 0.05
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


def stored_profile(setting: LogSetting, overhead_ns: float) -> StepModel | None:
    """The calibration profile's model for the log's model and setting (with the log's overhead), or None."""
    if setting.is_stub or not setting.fingerprint:
        return None
    found = load_profile(setting.fingerprint, setting.device, setting.dtype, setting.threads)
    if found is None:
        return None
    profile, path = found
    return dataclasses.replace(profile.fit(path), overhead_ns=overhead_ns)


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

    def describe(self, model: StepModel) -> str:
        dims = ", ".join(f"{d.replace('_', ' ')}: {n}" for d, n in self.by_dimension.items())
        return (f"EXTRAPOLATION: {self.outside} of the what-if's {self.steps} steps ({self.fraction:.0%}) lie outside "
                f"the range the step model is valid for ({model.describe_range()}; outside in {dims}): their "
                f"times, and the figures that depend on them, are a guess")

    def to_json(self) -> dict[str, object]:
        return {"steps": self.steps, "outside": self.outside, "by_dimension": self.by_dimension}


def choose(fitted: StepModel, profile: StepModel | None, on_fitted: Extrapolation,
           on_profile: Extrapolation | None) -> StepModel:
    """The model the what-if keeps, with its reason (``fitted`` was run first; ``on_*``: each one's extrapolation
    over the what-if's steps)."""
    if fitted.source == "stub":
        return fitted
    if fitted.source == "log" and fitted.samples >= MIN_LOG_SAMPLES and on_fitted.fraction <= SPAN_TOLERANCE:
        return dataclasses.replace(fitted, why=f"fitted on the log's own steps, which span "
                                               f"{1 - on_fitted.fraction:.0%} of the what-if's steps")
    if profile is None or on_profile is None:
        missing = "no calibration profile is stored for this model and setting (`tickloom bench calibrate` makes one)"
        if fitted.source != "log":
            return dataclasses.replace(fitted, why=f"the log has no measured step times and {missing}")
        return dataclasses.replace(fitted, why=f"fitted on the log's own steps ({fitted.samples}), which span "
                                               f"{1 - on_fitted.fraction:.0%} of the what-if's steps; {missing}")
    if fitted.source != "log":
        return dataclasses.replace(profile, why="the log has no measured step times: the calibration profile")
    if fitted.samples < MIN_LOG_SAMPLES:
        return dataclasses.replace(profile, why=f"the log has only {fitted.samples} measured steps: the "
                                                "calibration profile")
    if on_profile.outside < on_fitted.outside:
        return dataclasses.replace(profile, why=f"the log's steps ({fitted.describe_range()}) leave "
                                                f"{on_fitted.fraction:.0%} of the what-if's outside; the calibration "
                                                f"profile leaves {on_profile.fraction:.0%}")
    return dataclasses.replace(fitted, why=f"fitted on the log's own steps: the calibration profile covers no more "
                                           f"of the what-if's ({on_profile.fraction:.0%} outside it)")


def run_on_chosen_model(simulate: Callable[[StepClock], Simulator], setting: LogSetting, fitted: StepModel,
                        choice: ModelChoice) -> tuple[Simulator, StepModel, Extrapolation]:
    """The modelled run (``simulate``) on the model ``choice`` names (``auto``: ``choose``'s, running on the
    profile too only when the log's own model does not settle it), that model, and the run's extrapolation on it.
    ``calibration`` without a stored profile raises ``ValueError``."""
    profile = None if choice == "log" else stored_profile(setting, fitted.overhead_ns)
    if choice == "calibration":
        if profile is None:
            raise ValueError("no calibration profile is stored for this log's model and setting "
                             "(`tickloom bench calibrate` makes one)")
        profile = dataclasses.replace(profile, why="asked for (--step-model calibration)")
        sim = simulate(profile)
        return sim, profile, Extrapolation.of(profile, _steps(sim))
    sim = simulate(fitted)
    on_fitted = Extrapolation.of(fitted, _steps(sim))
    settled = fitted.source == "log" and on_fitted.fraction <= SPAN_TOLERANCE and fitted.samples >= MIN_LOG_SAMPLES
    if profile is None or fitted.source == "stub" or settled:
        return sim, choose(fitted, None, on_fitted, None), on_fitted
    other = simulate(profile)
    on_profile = Extrapolation.of(profile, _steps(other))
    model = choose(fitted, profile, on_fitted, on_profile)
    if model.source == "calibration":
        return other, model, on_profile
    return sim, model, on_fitted


def _steps(sim: Simulator) -> list[RunStep]:
    return [c for out in sim.outputs for c in out.commands if isinstance(c, RunStep)]
