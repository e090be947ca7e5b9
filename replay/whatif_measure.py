"""What a what-if (``replay/whatif.py``) measures: a run's metrics, and the step-time model of a log.

``measure`` takes any run's ``(TickInputs, TickOutputs)``: a log's, or a simulator's. So the original column of a
what-if comes from the log itself, and the what-if column from the re-simulated ticks, by one definition. Times are
the ticks' ``now_ns``: a token's time is that of the tick that emitted it, an arrival's that of the tick it came in.

``fit_step_model`` fits the logged steps' measured times (``StepSample``) to ``StepModel``, the modelled mode's clock.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from tickloom.events import EmitTokens, Finish, Preempted, RequestArrived, RunStep, SwapIn, TickInputs, TickOutputs
from tickloom.replay.sim import TICK_NS

Tick = tuple[TickInputs, TickOutputs]


@dataclasses.dataclass(slots=True)
class RunMetrics:
    """What a run did, as its clients and its log saw it. Latencies are in ns."""

    requests: int = 0
    completion_tokens: int = 0
    duration_ns: int = 0
    """From the first arrival to the last token or finish."""
    ttft_ns: list[int] = dataclasses.field(default_factory=list)
    itl_ns: list[int] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    requeues: int = 0
    swaps: int = 0
    swap_ins: int = 0
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    """request -> finish reason."""
    outputs: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """request -> the tokens its client received (truncated to the finish's count)."""

    @property
    def throughput(self) -> float:
        return self.completion_tokens / (self.duration_ns / 1e9) if self.duration_ns > 0 else 0.0

    @property
    def finish_reasons(self) -> dict[str, int]:
        return dict(sorted(Counter(self.reasons.values()).items()))

    @property
    def open(self) -> int:
        return self.requests - len(self.reasons)

    def summary(self) -> dict[str, object]:
        """The JSON form (latencies in ms)."""
        return {
            "requests": self.requests, "finished": len(self.reasons), "open": self.open,
            "completion_tokens": self.completion_tokens, "duration_s": self.duration_ns / 1e9,
            "throughput_tok_s": self.throughput,
            **{f"ttft_ms_p{q}": _ms(percentile(self.ttft_ns, q)) for q in (50, 90, 99)},
            **{f"itl_ms_p{q}": _ms(percentile(self.itl_ns, q)) for q in (50, 90, 99)},
            "preemptions": self.preemptions, "requeues": self.requeues, "swaps": self.swaps,
            "swap_ins": self.swap_ins, "timeouts": self.finish_reasons.get("timeout", 0),
            "finish_reasons": self.finish_reasons,
        }


def _ms(ns: float | None) -> float | None:
    return None if ns is None else ns / 1e6


def percentile(values: Sequence[int], q: float) -> float | None:
    """The q-th percentile (linear interpolation), or None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def measure(ticks: Iterable[Tick]) -> RunMetrics:
    """The metrics of a run from its ticks (a log's, or a simulator's ``zip(inputs, outputs)``)."""
    m = RunMetrics()
    arrived: dict[str, int] = {}
    stream: dict[str, list[tuple[int, int]]] = defaultdict(list)
    finishes: dict[str, Finish] = {}
    last = None
    for inputs, outputs in ticks:
        now = inputs.now_ns
        for msg in inputs.inputs:
            if isinstance(msg, RequestArrived):
                arrived.setdefault(msg.request_id, now)
        for command in outputs.commands:
            if isinstance(command, EmitTokens):
                for rid, token in zip(command.request_ids, command.token_ids, strict=True):
                    stream[rid].append((token, now))
                last = now
            elif isinstance(command, Finish):
                finishes.setdefault(command.request_id, command)
                last = now
            elif isinstance(command, Preempted):
                m.preemptions += 1
                m.requeues += command.mode == "requeue"
                m.swaps += command.mode == "swap"
            elif isinstance(command, SwapIn):
                m.swap_ins += 1
    m.requests = len(arrived)
    for rid in arrived:
        got = stream.get(rid, [])
        if rid in finishes:
            got = got[: finishes[rid].usage.completion_tokens]
            m.reasons[rid] = finishes[rid].reason
        m.outputs[rid] = [token for token, _ in got]
        m.completion_tokens += len(got)
        if got:
            m.ttft_ns.append(got[0][1] - arrived[rid])
            m.itl_ns += [b[1] - a[1] for a, b in itertools.pairwise(got)]
    if arrived and last is not None:
        m.duration_ns = last - min(arrived.values())
    return m


# -- the step-time model --------------------------------------------------------------------------------------
class StepSample(NamedTuple):
    """One logged step: its shape, its measured time, and its latency as the core saw it: from when the device
    could start it (its dispatch, or the previous result if that came later) to the tick its result came in."""

    tokens: int
    rows: int
    step_time_ns: int
    latency_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class StepModel:
    """``time = intercept + per_token·tokens + per_row·rows + overhead`` (ns), at least 1 ns. The first three terms
    are the least-squares fit of the measured step times; ``overhead`` is the median of what the core waited
    beyond them (host work, result delivery)."""

    intercept_ns: float
    per_token_ns: float = 0.0
    per_row_ns: float = 0.0
    overhead_ns: float = 0.0
    samples: int = 0
    """Steps with a measured time that the fit used."""
    mean_abs_error_ns: float = 0.0
    """Of the fit, over those steps."""

    def device_time(self, tokens: int, rows: int) -> float:
        return self.intercept_ns + self.per_token_ns * tokens + self.per_row_ns * rows

    def time(self, tokens: int, rows: int) -> int:
        return max(1, round(self.device_time(tokens, rows) + self.overhead_ns))

    def predict(self, step: RunStep) -> int:
        return self.time(len(step.token_ids), len(step.request_ids))

    def describe(self) -> str:
        overhead = f" + {self.overhead_ns / 1e3:.1f} µs overhead (the median wait beyond the measured step time)"
        if not self.samples:
            return f"the log has no measured step times: every step takes {self.intercept_ns / 1e3:.1f} µs{overhead}"
        return (f"step time = {self.intercept_ns / 1e3:.1f} µs + {self.per_token_ns / 1e3:.3f} µs·tokens + "
                f"{self.per_row_ns / 1e3:.3f} µs·rows (least squares on {self.samples} logged steps, mean absolute "
                f"error {self.mean_abs_error_ns / 1e3:.1f} µs){overhead}")


def fit_step_model(samples: Sequence[StepSample]) -> StepModel:
    """Least squares of the measured step times on (1, tokens, rows), dropping the terms the samples cannot
    separate, plus the median overhead. No measured time at all: the median latency, or 1 ms without any step."""
    measured = [s for s in samples if s.step_time_ns > 0]
    if not measured:
        latency = statistics.median(s.latency_ns for s in samples) if samples else TICK_NS
        return StepModel(float(latency))
    overhead = max(0.0, float(statistics.median(s.latency_ns - s.step_time_ns for s in measured)))
    for terms in ((0, 1, 2), (0, 1), (0, 2), (0,)):
        coef = _least_squares([[(1, s.tokens, s.rows)[t] for t in terms] for s in measured],
                              [float(s.step_time_ns) for s in measured])
        if coef is not None:
            full = [0.0, 0.0, 0.0]
            for term, value in zip(terms, coef, strict=True):
                full[term] = round(value, 3) + 0.0  # + 0.0: no -0.0
            model = StepModel(full[0], full[1], full[2], overhead, len(measured))
            error = sum(abs(model.device_time(s.tokens, s.rows) - s.step_time_ns) for s in measured) / len(measured)
            return dataclasses.replace(model, mean_abs_error_ns=error)
    raise AssertionError("the intercept alone always fits")


def _least_squares(x: list[list[int]], y: list[float]) -> list[float] | None:
    """Solve the normal equations by Gaussian elimination; None if they are (numerically) singular."""
    n = len(x[0])
    if len(x) < n:
        return None
    a = [[float(sum(row[i] * row[j] for row in x)) for j in range(n)] for i in range(n)]
    b = [float(sum(row[i] * v for row, v in zip(x, y, strict=True))) for i in range(n)]
    scale = max(abs(a[i][i]) for i in range(n))
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-9 * scale:
            return None
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            a[r] = [v - f * w for v, w in zip(a[r], a[col], strict=True)]
            b[r] -= f * b[col]
    out = [0.0] * n
    for i in reversed(range(n)):
        out[i] = (b[i] - sum(a[i][j] * out[j] for j in range(i + 1, n))) / a[i][i]
    return out
