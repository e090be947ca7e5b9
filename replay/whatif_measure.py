"""What a what-if (``replay/whatif.py``) measures: a run's metrics, and the interval around each predicted figure.

``measure`` takes any run's ``(TickInputs, TickOutputs)``: a log's, or a simulator's. So the original column of a
what-if comes from the log itself, and the what-if column from the re-simulated ticks, by one definition. Times are
the ticks' ``now_ns``: a token's time is that of the tick that emitted it, an arrival's that of the tick it came in.

``intervals`` puts a range around each predicted figure: the least and the most it came to over the runs with the
step times drawn from the model's residuals (``replay/whatif_model.py``). The step-time model itself, the modelled
mode's clock, is ``replay/step_model.py``'s.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence

from tickloom.events import EmitTokens, Finish, Preempted, RequestArrived, SwapIn, TickInputs, TickOutputs

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


FIGURES = ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p90", "itl_ms_p99", "throughput_tok_s",
           "duration_s")
"""The predicted figures that get an interval."""


def intervals(point: Mapping[str, object], draws: Sequence[Mapping[str, object]]) -> dict[str, tuple[float, float]]:
    """Per figure of ``FIGURES``, the (least, most) it came to over the ``point`` run's summary and the ``draws``'
    (``RunMetrics.summary``, or any with those keys; a figure some run cannot give, such as a latency with no token,
    is left out)."""
    out: dict[str, tuple[float, float]] = {}
    runs = [point, *draws]
    for key in FIGURES:
        values = [v for s in runs if isinstance(v := s.get(key), int | float)]
        if len(values) == len(runs):
            out[key] = (float(min(values)), float(max(values)))
    return out
