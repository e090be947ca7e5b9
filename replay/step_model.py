"""The what-if's clock: how long a step takes (``StepModel``), and where that knowledge comes from.

A step's device time is modelled as

    time = per_step + per_prefill_token·prefill tokens + per_decode_row·decode rows + per_context·context read
           + per_prefill_chunk·prefill chunks + per_matrix_step·[the step has two tokens or more]

(``StepShape``): a fixed share per step (the host's Python, the launch), the prompt tokens a step prefills, the
decode rows it samples (each one a token through the layers and a row of the LM head), the attention's reads (each
new token reads every earlier position of its sequence, so a row of n tokens from position p reads n·p + n(n+1)/2
key positions), the prefill chunks (rows of more than one token, which take the masked attention path), and whether
the step multiplies matrices at all: a step of one token runs matrix-vector products, one of two tokens or more
matrix-matrix products, whose kernels cost more to start (on the default model on a CPU, one decode row takes 80 ms
and two 140 ms, then each further row some 15 ms). Every cost is at least 0 (``fit_step_model`` is a non-negative
least squares: the best fit over the subsets of terms whose own least squares comes out non-negative, exact for six
terms). Step times vary by a factor, not by an amount (a busy host slows a big step as much as a small one), so the
fit weighs each step by its time's inverse: it minimises the relative errors. A plain least squares of
``a + b·tokens + c·rows`` on decode steps, where tokens and rows move together, came out with a negative cost per
row and an intercept larger than a whole step, and predicted batch 1 slower per token than batch 3.

The model knows where it is valid: ``StepModel.bounds`` is the box of shapes its samples covered, and ``outside``
says which dimension a shape leaves it in. ``ratios`` are the samples' measured / predicted times, the residuals
the what-if draws from to put an interval around each figure.

Where a model comes from (``StepModel.source``):

- ``stub``: the log was written by the stub model, whose every step takes ``stub_step_time`` (exact, valid for any
  shape);
- ``log``: fitted on the log's own measured steps;
- ``calibration``: fitted on a calibration profile (``tickloom bench calibrate``: the model's steps measured on
  this machine over a grid of shapes, stored in the cache, ``profile_path``); the what-if uses it when the log's
  own steps do not span the shapes the what-if runs;
- ``latency``: the log has steps but no measured step time (a core-level log): every step takes their median
  latency;
- ``none``: the log has no step: every step takes 1 ms.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, NamedTuple

from tickloom.events import RunStep

Source = Literal["stub", "log", "calibration", "latency", "none"]
TERMS = ("per_step", "per_prefill_token", "per_decode_row", "per_context", "per_prefill_chunk", "per_matrix_step")
"""The model's terms, in the order of ``StepShape.features``."""
DIMENSIONS = ("prefill_tokens", "decode_rows", "context")
"""A shape's dimensions, each checked against the range the model was fitted on."""
SLACK = 0.1
"""A shape up to 10% beyond the fitted range (and 10% below its low end) still counts as inside."""
MAX_RATIOS = 512
LOCAL_SAMPLES = 3
"""A class of step needs this many of a log's steps for its own scale (``rescaled``)."""
PREFILL_CLASS = 0
"""``step_class`` of a step that prefills (a decode class is its row count, 1 or more)."""
PROFILE_VERSION = 1


class StepShape(NamedTuple):
    """What a step's cost depends on (see the module docstring)."""

    prefill_tokens: int
    decode_rows: int
    context: int
    """Key positions the step's attention reads, over all its tokens."""
    prefill_chunks: int = 0
    """Rows of more than one token."""

    @classmethod
    def of(cls, step: RunStep) -> StepShape:
        prefill = decode = context = chunks = 0
        for n, p in zip(step.num_tokens, step.positions, strict=True):
            if n == 1:
                decode += 1
            else:
                prefill += n
                chunks += 1
            context += n * p + n * (n + 1) // 2
        return cls(prefill, decode, context, chunks)

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.prefill_tokens), float(self.decode_rows), float(self.context),
                float(self.prefill_chunks), 1.0 if self.prefill_tokens + self.decode_rows >= 2 else 0.0)

    def dimensions(self) -> tuple[int, int, int]:
        """The values ``DIMENSIONS`` names."""
        return (self.prefill_tokens, self.decode_rows, self.context)


class StepSample(NamedTuple):
    """One step: its shape and its measured device time; ``latency_ns`` is what the core saw (from when the device
    could start it, its dispatch or the previous result, to the tick its result came in), 0 when unknown."""

    shape: StepShape
    step_time_ns: int
    latency_ns: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class StepModel:
    """A step's modelled time (see the module docstring): ``time`` = the terms + ``overhead_ns``, at least 1 ns."""

    per_step_ns: float
    per_prefill_token_ns: float = 0.0
    per_decode_row_ns: float = 0.0
    per_context_ns: float = 0.0
    per_prefill_chunk_ns: float = 0.0
    per_matrix_step_ns: float = 0.0
    overhead_ns: float = 0.0
    """The median of what the core waited beyond a step's measured time (result delivery, the tick)."""
    source: Source = "none"
    samples: int = 0
    mean_abs_error_ns: float = 0.0
    bounds: tuple[tuple[int, int], ...] | None = None
    """Per ``DIMENSIONS``, the (low, high) its samples covered; None: valid for any shape (the stub)."""
    ratios: tuple[float, ...] = ()
    """Sorted measured / predicted times of its samples (at most ``MAX_RATIOS``, evenly picked)."""
    why: str = ""
    """Why this model was chosen (the what-if fills it in)."""
    profile_path: str | None = None
    local: tuple[tuple[int, float], ...] = ()
    """A profile scaled to a log (``rescaled``): per class of step (``step_class``) where the log has
    ``LOCAL_SAMPLES`` or more steps, the median of their measured / modelled times, which multiplies the terms for
    every step of that class (a decode class the log lacks takes its nearest row count's); empty: none."""

    @property
    def coefficients(self) -> tuple[float, ...]:
        return (self.per_step_ns, self.per_prefill_token_ns, self.per_decode_row_ns, self.per_context_ns,
                self.per_prefill_chunk_ns, self.per_matrix_step_ns)

    def device_time(self, shape: StepShape) -> float:
        terms = sum(c * f for c, f in zip(self.coefficients, shape.features(), strict=True))
        return terms * self.local_scale(shape) if self.local else terms

    def local_scale(self, shape: StepShape) -> float:
        """``local``'s factor for ``shape`` (1.0 for a class it has no word on)."""
        cls = step_class(shape)
        found = dict(self.local)
        if cls in found or cls == PREFILL_CLASS:
            return found.get(cls, 1.0)
        rows = [(abs(c - cls), -c) for c in found if c != PREFILL_CLASS]
        return found[-min(rows)[1]] if rows else 1.0

    def time(self, shape: StepShape) -> int:
        return max(1, round(self.device_time(shape) + self.overhead_ns))

    def predict(self, step: RunStep) -> int:
        return self.time(StepShape.of(step))

    def scaled(self, factor: float) -> StepModel:
        """Every cost and the overhead times ``factor`` (a host that gives the steps less of a CPU); the residual
        ratios, being relative, stay."""
        return dataclasses.replace(
            self, per_step_ns=self.per_step_ns * factor, per_prefill_token_ns=self.per_prefill_token_ns * factor,
            per_decode_row_ns=self.per_decode_row_ns * factor, per_context_ns=self.per_context_ns * factor,
            per_prefill_chunk_ns=self.per_prefill_chunk_ns * factor,
            per_matrix_step_ns=self.per_matrix_step_ns * factor, overhead_ns=self.overhead_ns * factor,
            mean_abs_error_ns=self.mean_abs_error_ns * factor)

    def outside(self, shape: StepShape) -> tuple[str, ...]:
        """The dimensions in which ``shape`` leaves the fitted range (beyond ``SLACK``)."""
        if self.bounds is None:
            return ()
        return tuple(name for name, value, (lo, hi) in zip(DIMENSIONS, shape.dimensions(), self.bounds, strict=True)
                     if value > hi * (1 + SLACK) or value < lo * (1 - SLACK))

    def describe_range(self) -> str:
        if self.bounds is None:
            return "any step"
        return ", ".join(f"{name.replace('_', ' ')} {lo}-{hi}" for name, (lo, hi) in zip(DIMENSIONS, self.bounds,
                                                                                       strict=True))

    def describe(self) -> str:
        overhead = f" + {self.overhead_ns / 1e3:.1f} µs overhead (the median wait beyond the measured step time)"
        if self.source == "stub":
            return f"the stub model: every step takes {self.per_step_ns / 1e6:g} ms (exact)"
        if self.source in ("latency", "none"):
            what = "no measured step times" if self.source == "latency" else "no steps"
            return f"the log has {what}: every step takes {self.per_step_ns / 1e3:.1f} µs"
        where = "the log's" if self.source == "log" else f"the calibration profile's ({self.profile_path or 'unsaved'})"
        return (f"step time = {self.per_step_ns / 1e3:.1f} µs + {self.per_prefill_token_ns / 1e3:.3f} µs·prefill "
                f"tokens + {self.per_decode_row_ns / 1e3:.3f} µs·decode rows + {self.per_context_ns:.3f} ns·context "
                f"read + {self.per_prefill_chunk_ns / 1e3:.1f} µs·prefill chunks + {self.per_matrix_step_ns / 1e3:.1f} "
                f"µs·matrix step (non-negative least squares, relative, on "
                f"{where} {self.samples} steps, mean absolute error {self.mean_abs_error_ns / 1e3:.1f} µs; valid for "
                f"{self.describe_range()}){overhead}{self.describe_local()}")

    def describe_local(self) -> str:
        if not self.local:
            return ""
        return "; each class of step the log measured scaled by its own steps: " + ", ".join(
            f"{'prefill' if c == PREFILL_CLASS else f'{c} row' + 's' * (c > 1)} x{f:.2f}" for c, f in self.local)

    def to_json(self) -> dict[str, object]:
        return {"source": self.source, "why": self.why, "per_step_ns": self.per_step_ns,
                "per_prefill_token_ns": self.per_prefill_token_ns, "per_decode_row_ns": self.per_decode_row_ns,
                "per_context_ns": self.per_context_ns, "per_prefill_chunk_ns": self.per_prefill_chunk_ns,
                "per_matrix_step_ns": self.per_matrix_step_ns,
                "overhead_ns": self.overhead_ns, "samples": self.samples,
                "mean_abs_error_ns": self.mean_abs_error_ns,
                "valid_for": None if self.bounds is None else {n: list(r) for n, r in zip(DIMENSIONS, self.bounds,
                                                                                         strict=True)},
                "profile": self.profile_path,
                "local": {("prefill" if c == PREFILL_CLASS else f"{c} rows"): f for c, f in self.local}}


def stub_model(step_time_s: float) -> StepModel:
    """The stub model's clock: every step takes ``step_time_s`` (``EngineConfig.stub_step_time``), exactly."""
    return StepModel(float(round(step_time_s * 1e9)), source="stub", why="the log was written by the stub model, "
                     "whose step time is fixed")


def fit_step_model(samples: Sequence[StepSample], source: Source = "log",
                   latencies: Sequence[int] = ()) -> StepModel:
    """The non-negative least squares of ``samples``' measured times on the terms, each weighed by its time's
    inverse (relative errors), plus the median overhead.

    No measured time at all: the median of ``latencies`` (``source="latency"``), or 1 ms without any
    (``source="none"``)."""
    measured = [s for s in samples if s.step_time_ns > 0]
    if not measured:
        if latencies:
            return StepModel(float(statistics.median(latencies)), source="latency")
        return StepModel(1e6, source="none")
    seen = [s.latency_ns - s.step_time_ns for s in measured if s.latency_ns > 0]
    overhead = max(0.0, float(statistics.median(seen))) if seen else 0.0
    coef = nnls([[f / s.step_time_ns for f in s.shape.features()] for s in measured], [1.0] * len(measured))
    per_step, per_prefill, per_decode, per_context, per_chunk, per_matrix = (round(c, 3) + 0.0 for c in coef)
    model = StepModel(per_step, per_prefill, per_decode, per_context, per_chunk, per_matrix, overhead_ns=overhead,
                      source=source,
                      samples=len(measured),
                      bounds=tuple((min(s.shape.dimensions()[d] for s in measured),
                                    max(s.shape.dimensions()[d] for s in measured)) for d in range(len(DIMENSIONS))))
    error = sum(abs(model.device_time(s.shape) - s.step_time_ns) for s in measured) / len(measured)
    return dataclasses.replace(model, mean_abs_error_ns=error, ratios=residual_ratios(model, measured))


def residual_ratios(model: StepModel, samples: Sequence[StepSample]) -> tuple[float, ...]:
    """The samples' measured / modelled times, sorted (at most ``MAX_RATIOS``, evenly picked): as the core saw them
    (its latency against the modelled time, overhead included) where a sample has a latency, else the device's."""
    ratios = sorted((s.latency_ns if s.latency_ns > 0 else s.step_time_ns)
                    / max(1.0, model.device_time(s.shape) + (model.overhead_ns if s.latency_ns > 0 else 0.0))
                    for s in samples if s.step_time_ns > 0)
    if len(ratios) > MAX_RATIOS:
        ratios = [ratios[round(i * (len(ratios) - 1) / (MAX_RATIOS - 1))] for i in range(MAX_RATIOS)]
    return tuple(ratios)


def step_class(shape: StepShape) -> int:
    """A step's class for ``StepModel.local``: ``PREFILL_CLASS`` if it prefills, else its decode rows."""
    return PREFILL_CLASS if shape.prefill_tokens else shape.decode_rows


def rescaled(model: StepModel, samples: Sequence[StepSample]) -> tuple[StepModel, float]:
    """``model`` (a profile's) with every cost scaled by the median of ``samples``' measured / modelled device
    times, then each class of step (``step_class``) the samples have ``LOCAL_SAMPLES`` of scaled again by their
    own median (``StepModel.local``), and its residual ratios taken from the samples: the profile's shape, at the
    speed the log ran at, and where the log measured a kind of step itself, at the log's time for it. A busy host
    does not slow every shape alike (with other work on both cores, a 4-row decode step's running time grew 49%
    and a 1-row step's 29%); the log's own steps of a class say how its steps ran then. Returns the model and the
    overall scale (1.0, and the model as it is, without measured samples)."""
    measured = [s for s in samples if s.step_time_ns > 0]
    if not measured:
        return model, 1.0
    scale = float(statistics.median(s.step_time_ns / max(1.0, model.device_time(s.shape)) for s in measured))
    out = dataclasses.replace(model.scaled(scale), overhead_ns=model.overhead_ns,
                              mean_abs_error_ns=model.mean_abs_error_ns, local=())
    by_class: dict[int, list[float]] = {}
    for s in measured:
        by_class.setdefault(step_class(s.shape), []).append(s.step_time_ns / max(1.0, out.device_time(s.shape)))
    local = tuple(sorted((c, float(statistics.median(r))) for c, r in by_class.items() if len(r) >= LOCAL_SAMPLES))
    out = dataclasses.replace(out, local=local)
    return dataclasses.replace(out, ratios=residual_ratios(out, measured)), scale


def nnls(x: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """The least squares solution of ``x·c = y`` with every ``c >= 0``.

    The constrained optimum is the unconstrained least squares on some subset of the columns (its support), and
    it is non-negative there; so the best non-negative solution over all subsets is the optimum. With six columns
    that is 63 small solves of the normal equations (built once)."""
    n = len(x[0])
    gram = [[sum(row[i] * row[j] for row in x) for j in range(n)] for i in range(n)]
    moment = [sum(row[i] * v for row, v in zip(x, y, strict=True)) for i in range(n)]
    yy = sum(v * v for v in y)
    best: tuple[float, list[float]] = (yy, [0.0] * n)  # the empty support: every cost 0
    for size in range(1, n + 1):
        for support in itertools.combinations(range(n), size):
            coef = _solve([[gram[i][j] for j in support] for i in support], [moment[i] for i in support])
            if coef is None or min(coef) < 0:
                continue
            full = [0.0] * n
            for i, c in zip(support, coef, strict=True):
                full[i] = c
            # ||y - x c||² = y·y - 2 c·(xᵀy) + cᵀ(xᵀx)c
            sse = yy - 2 * sum(c * m for c, m in zip(full, moment, strict=True)) + sum(
                full[i] * gram[i][j] * full[j] for i in range(n) for j in range(n))
            if sse < best[0] - 1e-9 * max(1.0, abs(best[0])):
                best = (sse, full)
    return best[1]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a scaled copy; None if (numerically) singular."""
    n = len(b)
    scale = [max(abs(a[i][i]), 1e-300) ** 0.5 for i in range(n)]
    a = [[a[i][j] / (scale[i] * scale[j]) for j in range(n)] for i in range(n)]
    b = [b[i] / scale[i] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-10:
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            a[r] = [v - f * w for v, w in zip(a[r], a[col], strict=True)]
            b[r] -= f * b[col]
    out = [0.0] * n
    for i in reversed(range(n)):
        out[i] = (b[i] - sum(a[i][j] * out[j] for j in range(i + 1, n))) / a[i][i]
    return [v / s for v, s in zip(out, scale, strict=True)]


# -- calibration profiles ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
    """A model's step times measured on one machine (``tickloom bench calibrate``)."""

    model: str
    fingerprint: str
    device: str
    dtype: str
    threads: int
    machine: str
    samples: tuple[StepSample, ...]

    def to_json(self) -> str:
        return json.dumps({"version": PROFILE_VERSION, "model": self.model, "fingerprint": self.fingerprint,
                           "device": self.device, "dtype": self.dtype, "threads": self.threads,
                           "machine": self.machine,
                           "samples": [[*s.shape, s.step_time_ns] for s in self.samples]})

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """Raises ``ValueError`` for anything but a profile of this version."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            raise ValueError("not a tickloom calibration profile of version 1")
        try:
            samples = tuple(StepSample(StepShape(int(p), int(d), int(c), int(k)), int(t))
                            for p, d, c, k, t in data["samples"])
            return cls(str(data["model"]), str(data["fingerprint"]), str(data["device"]), str(data["dtype"]),
                       int(data["threads"]), str(data["machine"]), samples)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"a malformed calibration profile: {type(exc).__name__}: {exc}") from exc

    def fit(self, path: str | os.PathLike[str] | None = None) -> StepModel:
        model = fit_step_model(self.samples, source="calibration")
        return dataclasses.replace(model, profile_path=None if path is None else os.fspath(path))


def profile_path(fingerprint: str, device: str, dtype: str, threads: int) -> Path:
    """Where the profile of a model (by weight fingerprint) on a device, dtype and thread count lives: beside the
    models in the cache (``engine.model.registry.cache_dir``), ``calibration/<fingerprint>-<setting>.json``."""
    from tickloom.engine.model.registry import cache_dir

    setting = hashlib.blake2b(f"{device}|{dtype}|{threads}".encode(), digest_size=6).hexdigest()
    safe = "".join(ch for ch in fingerprint if ch.isalnum())[:32] or "unknown"
    return cache_dir() / "calibration" / f"{safe}-{setting}.json"


def load_profile(fingerprint: str, device: str, dtype: str, threads: int) -> tuple[Profile, Path] | None:
    """The stored profile for that model and setting, or None if there is none (a malformed one raises
    ``ValueError`` naming its path)."""
    path = profile_path(fingerprint, device, dtype, threads)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return Profile.from_json(text), path
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def save_profile(profile: Profile) -> Path:
    """Write ``profile`` to its place in the cache (atomically: a temporary file renamed); returns the path."""
    path = profile_path(profile.fingerprint, profile.device, profile.dtype, profile.threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(profile.to_json(), encoding="utf-8")
    os.replace(tmp, path)
    return path
