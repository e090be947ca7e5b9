"""``tickloom whatif LOG --set ... --validate``: the what-if's prediction checked against a real run.

The log's client inputs are re-run for real under the what-if's configuration: an ``Engine`` built from the log's
own engine configuration (its model, or the stub when the log was made with the stub) with the ``--set`` changes
applied, each request submitted with its logged prompt, sampling and seed at its logged time after the first
arrival, each cancel or departed client at its logged time, each deadline as far after its arrival as it was. A
stub run plays under trio's ``MockClock`` (virtual time: exact and instant); a model's runs in real time. The real
run writes its own log (in a temporary directory), and its figures come from that log through the same
``replay.whatif_measure.measure`` as the prediction's, so the two columns share every definition.

``ValidateReport`` lines them up: predicted (with its interval), measured, and predicted / measured, for TTFT and
inter-token latency (p50, p90) and throughput.

**The host.** A model's step times follow the host's speed, and on a shared machine that speed moves by a factor
within minutes: the same arrivals under the log's own configuration, re-run a few times an hour after the log,
took 1.0-2.3x the log's inter-token p50 (this project's 2 cores, with other sessions' tests coming and going). That
is the host's error, not the model's, and a validation that charges it to the model says nothing. Two corrections,
both measured in the same command as the real run they are set against:

- *A baseline re-run.* For a model's log (``baseline="rerun"``, the default there) the log's arrivals are first
  re-run for real under the log's *own* configuration, and the prediction compared is the what-if of that fresh
  recording: the step model is fitted to (or its calibration profile scaled to) steps measured minutes before the
  changed run, not whenever the log was made.
- *The slowdown of each run.* Load still comes and goes between two runs a minute apart. Each real run's device
  thread's time running and time waiting, runnable, for a CPU are read from Linux's scheduler statistics while it
  runs (``tools/bench/host_share.py``); (running + waiting) / running is how much slower the host made that run,
  and the prediction's step times are multiplied by the changed run's slowdown over the baseline's. This uses
  nothing of the changed run's latencies, only how much of a CPU it got. (It cannot see memory bandwidth or
  caches shared with other work; what is left of the host's noise shows in the rounds.)

The report also gives, per round, the prediction without the slowdowns, the baseline's figures against the log's,
and the prediction made from the log as recorded, so the drift is shown, not hidden. ``rounds`` repeats the real
runs and compares each figure's median. A stub log runs in virtual time, where nothing drifts: its baseline is the
log, and nothing is scaled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import median
from typing import Any, Literal

import msgspec
import trio
import trio.testing

from tickloom.api import Engine, RequestStream
from tickloom.config import EngineConfig
from tickloom.engine.core import CoreConfig
from tickloom.events import ClientGone, Input, LogHeader, LogReader, RequestArrived, RequestCancelled, Shutdown
from tickloom.fleet.logged_router import LoggedRouter
from tickloom.fleet.router_events import LoadReport, Route, RouterConfig
from tickloom.fleet.router_replay import ROUTER_LOG, incarnation_log, replica_logs
from tickloom.fleet.whatif import FleetMetrics, FleetWhatIf, read_fleet
from tickloom.replay.whatif import LoggedRun, WhatIfResult, read_log, whatif
from tickloom.replay.whatif_measure import RunMetrics, measure
from tickloom.replay.whatif_model import ModelChoice
from tickloom.tools.bench.host_share import INTERVAL_S, Slowdown

Baseline = Literal["auto", "rerun", "log"]

FIGURES = (("TTFT p50 (ms)", "ttft_ms_p50"), ("TTFT p90 (ms)", "ttft_ms_p90"),
           ("inter-token p50 (ms)", "itl_ms_p50"), ("inter-token p90 (ms)", "itl_ms_p90"),
           ("throughput (tok/s)", "throughput_tok_s"))
"""The validated figures: (row label, ``RunMetrics.summary`` key)."""
COUNTS = ("preemptions", "requeues", "swaps")
"""Counts the report sets side by side too (a median over rounds)."""


class ValidateError(ValueError):
    """The log cannot be re-run (no engine configuration, a change an engine cannot take): one line."""


def engine_config_for(header: LogHeader, config: CoreConfig, log_path: str) -> EngineConfig:
    """The log's engine configuration with the what-if's core ``config`` applied, logging to ``log_path``, faults
    off; raises ``ValidateError``."""
    try:
        data = json.loads(header.config_json)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValidateError(f"the log's configuration is not JSON: {exc}") from exc
    engine = data.get("engine") if isinstance(data, dict) else None
    if not isinstance(engine, dict) or not isinstance(engine.get("model"), str):
        raise ValidateError("--validate re-runs an engine: this log has no engine configuration (it was written by "
                            "the core alone)")
    fields = set(EngineConfig.__struct_fields__)
    values = {k: v for k, v in engine.items() if k in fields}
    values.update(log_path=log_path, faults=None)
    for name in CoreConfig.__struct_fields__:
        if name in fields:
            values[name] = getattr(config, name)
    core = data.get("core", {})
    for name in ("vocab_size", "eos_token_ids", "spill_enabled"):
        if name in core and getattr(config, name) != msgspec.convert(core[name], type=type(getattr(config, name))):
            raise ValidateError(f"--validate: {name} comes from the model and the spill settings; an engine "
                                "cannot be given another")
    try:
        return msgspec.convert(values, EngineConfig)
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValidateError(f"--validate: the changed engine configuration is refused: {exc}") from exc


async def rerun(run: LoggedRun, config: EngineConfig, slowdown: list[Slowdown] | None = None) -> None:
    """Play ``run``'s client inputs into an engine built from ``config``, at their logged times after the first
    arrival (see the module docstring); returns once every request has ended. ``slowdown``: a list to append the
    run's ``Slowdown`` to (sampled from the engine's start to the last request's end)."""
    if any(isinstance(m, Shutdown) for _, m in run.clients):  # refused before the engine starts, not from a nursery
        raise ValidateError("--validate: the log ends requests with a shutdown, which a re-run cannot play")
    arrivals = [(t, m) for t, m in run.clients if isinstance(m, RequestArrived)]
    if not arrivals:
        return
    first = min(t for t, _ in arrivals)
    streams: dict[str, RequestStream] = {}

    async def submit(engine: Engine, at_s: float, arrival: RequestArrived, deadline_s: float | None) -> None:
        await trio.sleep_until(start + at_s)
        stream = RequestStream(engine, arrival.request_id, [msgspec.structs.replace(arrival, deadline_ns=None)],
                               deadline_s)
        streams[arrival.request_id] = stream
        async for _ in stream:
            pass

    async def follow(engine: Engine, at_s: float, request_id: str) -> None:
        await trio.sleep_until(start + at_s)
        stream = streams.get(request_id)
        if stream is not None:
            await stream.aclose()

    async def sample(host: Slowdown) -> None:
        while True:
            await trio.sleep(INTERVAL_S)
            host.sample()

    async with Engine.open(config) as engine, trio.open_nursery() as sampling:
        if slowdown is not None:
            slowdown.append(Slowdown())
            sampling.start_soon(sample, slowdown[-1])
        async with trio.open_nursery() as nursery:
            start = trio.current_time()
            for t, msg in run.clients:
                at = max(0, t - first) / 1e9
                if isinstance(msg, RequestArrived):
                    deadline = None if msg.deadline_ns is None else max(0, msg.deadline_ns - t) / 1e9
                    nursery.start_soon(submit, engine, at, msg, deadline)
                elif isinstance(msg, RequestCancelled | ClientGone):
                    nursery.start_soon(follow, engine, at + 1e-9, msg.request_id)
        if slowdown is not None:
            slowdown[-1].sample()
        sampling.cancel_scope.cancel()


def rerun_into(path: str | os.PathLike[str], run: LoggedRun, config: CoreConfig,
               log: Path) -> tuple[str, float | None]:
    """Re-run the log at ``path`` (read as ``run``) under ``config``, logging at ``log``; the clock it ran on and,
    in real time, the run's slowdown (``tools/bench/host_share.py``: None where unknown)."""
    with LogReader(path) as reader:
        header = reader.header
    engine = engine_config_for(header, config, str(log))
    if is_stub(run):
        trio.run(rerun, run, engine, clock=trio.testing.MockClock(autojump_threshold=0))
        return "virtual (the stub under trio's MockClock)", None
    host: list[Slowdown] = []
    trio.run(rerun, run, engine, host)
    return "real time", host[0].value if host else None


def run_for_real(path: str | os.PathLike[str], run: LoggedRun, config: CoreConfig) -> tuple[RunMetrics, str]:
    """Re-run the log at ``path`` (read as ``run``) under ``config``; its measured figures and the clock it ran on."""
    metrics, clock, _ = _measured_run(path, run, config)
    return metrics, clock


def _measured_run(path: str | os.PathLike[str], run: LoggedRun,
                  config: CoreConfig) -> tuple[RunMetrics, str, float | None]:
    with tempfile.TemporaryDirectory(prefix="tickloom-validate-") as tmp:
        log = Path(tmp) / "rerun.tlog"
        clock, slowdown = rerun_into(path, run, config, log)
        return measure(read_log(log).ticks), clock, slowdown


def is_stub(run: LoggedRun) -> bool:
    return run.setting is not None and run.setting.is_stub


@dataclasses.dataclass(slots=True)
class Round:
    """One round of a validation: the prediction's and the real run's summaries; with a re-run baseline, that
    baseline's measured summary, the prediction made from the log as recorded, the prediction from the baseline
    without the host's correction, and each real run's slowdown (``tools/bench/host_share.py``)."""

    predicted: dict[str, object]
    measured: dict[str, object]
    baseline: dict[str, object] | None = None
    from_log: dict[str, object] | None = None
    uncorrected: dict[str, object] | None = None
    baseline_slowdown: float | None = None
    slowdown: float | None = None

    @property
    def speed(self) -> float:
        """What the prediction's step times were multiplied by: the changed run's slowdown over the baseline's."""
        if self.baseline_slowdown is None or self.slowdown is None:
            return 1.0
        return self.slowdown / self.baseline_slowdown

    def to_json(self) -> dict[str, object]:
        def p50(summary: dict[str, object] | None) -> object:
            return None if summary is None else summary["itl_ms_p50"]

        return {"predicted_itl_ms_p50": p50(self.predicted), "measured_itl_ms_p50": p50(self.measured),
                "baseline_itl_ms_p50": p50(self.baseline), "from_log_itl_ms_p50": p50(self.from_log),
                "uncorrected_itl_ms_p50": p50(self.uncorrected), "baseline_slowdown": self.baseline_slowdown,
                "slowdown": self.slowdown, "speed": self.speed}


@dataclasses.dataclass(slots=True)
class ValidateReport:
    """Predicted against measured (see the module docstring): two summaries (``RunMetrics.summary`` or
    ``FleetMetrics.summary``; over several rounds, each figure's median), the prediction's intervals, and how it
    was made. ``log`` is the log's own summary, which a re-run baseline is set against."""

    predicted: dict[str, object]
    intervals: dict[str, tuple[float, float]]
    measured: dict[str, object]
    clock: str
    step_model: str
    extrapolated: bool
    rounds: list[Round] = dataclasses.field(default_factory=list)
    log: dict[str, object] | None = None

    @property
    def baseline(self) -> str:
        """What the prediction was made from: ``rerun`` (a fresh recording under the log's own configuration,
        each round) or ``log`` (the log as recorded)."""
        return "rerun" if any(r.baseline is not None for r in self.rounds) else "log"

    def rows(self) -> list[dict[str, Any]]:
        """Per figure: predicted, its interval, measured, and the ratio; over several rounds, the median of the
        rounds' own ratios (each round's prediction set against its own run, made at the same moment of the host),
        beside the medians of the predicted and the measured figures."""
        out = []
        for label, key in FIGURES:
            p, m = self.predicted[key], self.measured[key]
            lo, hi = self.intervals.get(key, (p, p) if isinstance(p, int | float) else (None, None))
            ratios = [_quotient(r.predicted[key], r.measured[key]) for r in self.rounds] or [_quotient(p, m)]
            ratio = median(x for x in ratios if x is not None) if None not in ratios else None
            out.append({"figure": label, "key": key, "predicted": p, "low": lo, "high": hi, "measured": m,
                        "ratio": ratio})
        return out

    def to_json(self) -> dict[str, object]:
        return {"clock": self.clock, "step_model": self.step_model, "extrapolated": self.extrapolated,
                "baseline": self.baseline, "rows": self.rows(), "rounds": [r.to_json() for r in self.rounds],
                "counts": {k: {"predicted": self.predicted.get(k), "measured": self.measured.get(k)} for k in COUNTS},
                "log_itl_ms_p50": None if self.log is None else self.log["itl_ms_p50"]}

    def format_text(self) -> str:
        lines = [f"validate: the log's arrivals re-run for real under the what-if's configuration ({self.clock})"]
        if self.baseline == "rerun":
            lines.append("baseline: before each changed run, the same arrivals re-run under the log's own "
                         "configuration; the prediction is the what-if of that fresh recording, its step times "
                         "scaled by the changed run's slowdown over the baseline's (each run's device thread's "
                         "(running + waiting for a CPU) / running)")
        if len(self.rounds) > 1:
            lines.append(f"{len(self.rounds)} rounds: each figure is the median over them, and each ratio the median "
                         "of the rounds' own ratios")
        lines.append(f"{'':22} {'predicted':>10} {'interval':>19} {'measured':>10} {'ratio':>7}")
        for row in self.rows():
            interval = "-" if row["low"] is None else f"{_num(row['low'])}-{_num(row['high'])}"
            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            lines.append(f"{row['figure']:22} {_num(row['predicted']):>10} {interval:>19} "
                         f"{_num(row['measured']):>10} {ratio:>7}")
        if self.extrapolated:
            lines.append("(the prediction extrapolates beyond its step model's range: see the notes)")
        if "preemptions" in self.predicted and "preemptions" in self.measured:
            lines.append(f"preemptions (requeued, swapped): predicted {_preemptions(self.predicted)}, measured "
                         f"{_preemptions(self.measured)}")
        if self.baseline == "rerun" or len(self.rounds) > 1:
            lines += self._round_lines()
        return "\n".join(lines)

    def _round_lines(self) -> list[str]:
        """Inter-token p50 of each round, with what went into it."""
        logged = None if self.log is None else self.log["itl_ms_p50"]
        lines = ["", f"inter-token p50 (ms) by round (the log: {_num(logged)})",
                 f"{'round':>5} {'predicted':>10} {'measured':>10} {'ratio':>7} {'slowdown':>15} {'uncorrected':>15} "
                 f"{'baseline':>10} {'from the log':>15}"]
        for i, r in enumerate(self.rounds, 1):
            p, m = r.predicted["itl_ms_p50"], r.measured["itl_ms_p50"]
            slow = f"{_factor(r.baseline_slowdown)}, {_factor(r.slowdown)}"
            plain, old = _against(r.uncorrected, m), _against(r.from_log, m)
            base = "-" if r.baseline is None else _num(r.baseline["itl_ms_p50"])
            lines.append(f"{i:>5} {_num(p):>10} {_num(m):>10} {_ratio(p, m):>7} {slow:>15} {plain:>15} {base:>10} "
                         f"{old:>15}")
        lines.append("(slowdown: the baseline's and the changed run's; uncorrected: the baseline's prediction "
                     "without the slowdowns; from the log: the prediction made from the log as recorded)")
        return lines


def _against(summary: dict[str, object] | None, measured: object) -> str:
    """A summary's inter-token p50 and its ratio to ``measured``."""
    if summary is None:
        return "-"
    return f"{_num(summary['itl_ms_p50'])} ({_ratio(summary['itl_ms_p50'], measured)})"


def _preemptions(summary: dict[str, object]) -> str:
    def count(value: object) -> str:  # a median over an even number of rounds can be a half
        return f"{value:g}" if isinstance(value, int | float) else "-"

    return f"{count(summary['preemptions'])} ({count(summary['requeues'])}, {count(summary['swaps'])})"


def _factor(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _quotient(a: object, b: object) -> float | None:
    return a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def _ratio(a: object, b: object) -> str:
    q = _quotient(a, b)
    return "-" if q is None else f"{q:.2f}x"


def _num(value: object) -> str:
    if not isinstance(value, int | float) or math.isnan(value):
        return "-"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}"


def validate(path: str | os.PathLike[str], prediction: WhatIfResult, run: LoggedRun, *,
             baseline: Baseline = "auto", rounds: int = 1, step_model: ModelChoice = "auto") -> ValidateReport:
    """Re-run the log for real under ``prediction``'s configuration and line the figures up (``ValidateError``).

    ``baseline``: ``rerun`` re-runs the log's arrivals under its own configuration before each changed run and
    compares the what-if of that fresh log (made on ``step_model``, its step times scaled by the changed run's
    slowdown over the baseline's); ``log`` compares ``prediction``, the log's own; ``auto``: ``rerun`` for a model's
    log, ``log`` for a stub's (virtual time: nothing drifts). ``rounds``: that many real runs (pairs, with a
    baseline), each figure the median over them."""
    if rounds < 1:
        raise ValidateError("--rounds takes a number >= 1")
    fresh = baseline == "rerun" or (baseline == "auto" and not is_stub(run))
    done: list[Round] = []
    spans: list[dict[str, tuple[float, float]]] = []
    clock = ""
    model, extrapolated = prediction.model.source, prediction.extrapolated
    for _ in range(rounds):
        if not fresh:
            measured, clock, slowdown = _measured_run(path, run, prediction.config)
            done.append(Round(prediction.whatif.summary(), measured.summary(), slowdown=slowdown))
            spans.append(prediction.intervals)
            continue
        with tempfile.TemporaryDirectory(prefix="tickloom-validate-") as tmp:
            log = Path(tmp) / "baseline.tlog"
            _, base_slowdown = rerun_into(path, run, run.config, log)
            measured, clock, slowdown = _measured_run(path, run, prediction.config)
            recorded = read_log(log)
            r = Round({}, measured.summary(), measure(recorded.ticks).summary(), prediction.whatif.summary(),
                      baseline_slowdown=base_slowdown, slowdown=slowdown)
            now = whatif(log, prediction.config, run=recorded, step_model=step_model, modelled=True, speed=r.speed)
            r.predicted = now.whatif.summary()
            r.uncorrected = r.predicted if r.speed == 1.0 else whatif(
                log, prediction.config, run=recorded, step_model=step_model, modelled=True, draws=0).whatif.summary()
        done.append(r)
        spans.append(now.intervals)
        model, extrapolated = now.model.source, extrapolated or now.extrapolated
    return ValidateReport(_median([r.predicted for r in done]), _median_spans(spans),
                          _median([r.measured for r in done]), clock, model, extrapolated, done,
                          prediction.original.summary())


def _median(summaries: Sequence[dict[str, object]]) -> dict[str, object]:
    """``summaries[0]`` with each of ``FIGURES``' figures and ``COUNTS``' counts the median over all of them (None if
    any lacks it)."""
    out = dict(summaries[0])
    for key in [key for _, key in FIGURES] + [k for k in COUNTS if k in out]:
        values = [v for s in summaries if isinstance(v := s[key], int | float)]
        out[key] = median(values) if len(values) == len(summaries) else None
    return out


def _median_spans(spans: Sequence[dict[str, tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    """Per figure every span has, the median low and the median high: the interval of a typical round (a round on a
    host that stalled for a while would stretch the least-to-most over the rounds, which is the host's spread, not
    the model's)."""
    keys = set.intersection(*(set(s) for s in spans)) if spans else set()
    return {k: (median(s[k][0] for s in spans), median(s[k][1] for s in spans)) for k in keys}


def validate_fleet(fleet_dir: str | os.PathLike[str], changes: dict[str, object],
                   prediction: FleetWhatIf) -> ValidateReport:
    """Re-run a stub fleet for real under the changed router configuration and line the figures up."""
    measured, clock = run_fleet_for_real(fleet_dir, changes)
    return ValidateReport(prediction.whatif.summary(), prediction.intervals, measured.summary(), clock,
                          prediction.model.source, prediction.extrapolated)


# -- a fleet --------------------------------------------------------------------------------------------------
async def rerun_fleet(arrivals: Sequence[tuple[int, RequestArrived]], router_config: RouterConfig,
                      engine: EngineConfig, fleet_dir: Path, deadline_after: Mapping[str, int] | None = None,
                      followups: Mapping[str, Sequence[tuple[int, Input]]] | None = None) -> None:
    """Play ``arrivals`` ((ns, request), in order; each request's deadline ``deadline_after`` ns after it arrives,
    and its ``followups``, cancels or departures, that many ns after it) into ``router_config``'s router and one
    real engine per replica (``engine``, each logging under ``fleet_dir`` as a fleet's replica does), all in this
    one trio run: before each arrival the router gets every replica's load from its core (exact and instant, as the
    fleet what-if assumes), and each finish as it happens. Ray is not involved: the replicas are the engines."""
    if not arrivals:
        return
    deadline_after = deadline_after or {}
    followups = followups or {}
    first = arrivals[0][0]
    fleet_dir.mkdir(parents=True, exist_ok=True)
    router = LoggedRouter(router_config, fleet_dir / ROUTER_LOG, lambda: int(trio.current_time() * 1e9))
    streams: dict[str, RequestStream] = {}

    async def serve(replica: Engine, arrival: RequestArrived, deadline_s: float | None) -> None:
        stream = RequestStream(replica, arrival.request_id, [arrival], deadline_s)
        streams[arrival.request_id] = stream
        async for _ in stream:
            pass
        router.finished(arrival.request_id)
        router.flush()

    async def follow(at_s: float, request_id: str) -> None:
        await trio.sleep_until(start + at_s)
        stream = streams.get(request_id)
        if stream is not None:
            await stream.aclose()

    async with contextlib.AsyncExitStack() as stack:
        engines: list[Engine] = []
        for index in range(router_config.replicas):
            path = incarnation_log(fleet_dir, index, 0)
            path.parent.mkdir(parents=True, exist_ok=True)
            config = msgspec.structs.replace(engine, log_path=str(path))
            engines.append(await stack.enter_async_context(Engine.open(config)))
        nursery = await stack.enter_async_context(trio.open_nursery())
        start = trio.current_time()
        for t, request in arrivals:
            await trio.sleep_until(start + (t - first) / 1e9)
            for index, replica in enumerate(engines):
                g = replica.runtime.core.gauges()
                router.report(LoadReport(index, g.waiting, g.running, g.free_blocks))
            commands = router.route(router.arrival(request.request_id, request.prompt_token_ids, request.cache_salt))
            for command in commands:
                if isinstance(command, Route):
                    after = deadline_after.get(request.request_id)
                    nursery.start_soon(serve, engines[command.replica], msgspec.structs.replace(request,
                                       deadline_ns=None), None if after is None else after / 1e9)
                    for delta, _ in followups.get(request.request_id, []):
                        nursery.start_soon(follow, (t - first + delta) / 1e9 + 1e-9, request.request_id)
    router.close()


def run_fleet_for_real(fleet_dir: str | os.PathLike[str], changes: dict[str, object]) -> tuple[FleetMetrics, str]:
    """Re-run a stub fleet directory's arrivals under its router configuration changed by ``changes``, in virtual
    time; its measured figures (read back from the re-run's own fleet directory, by the definitions of the fleet
    what-if's original column) and the clock. ``ValidateError`` for a fleet of a model (a real fleet needs Ray)."""
    logs = read_fleet(fleet_dir)
    if not logs.setting.is_stub:
        raise ValidateError("--validate re-runs a fleet on the stub only (a model's fleet runs on Ray); this fleet's "
                            "replicas ran a model")
    router_config = RouterConfig.checked({**msgspec.structs.asdict(logs.router), **changes})
    [(_, _, first_log), *_] = replica_logs(fleet_dir)
    with LogReader(first_log) as reader:
        header = reader.header
    with tempfile.TemporaryDirectory(prefix="tickloom-validate-") as tmp:
        again = Path(tmp) / "fleet"
        engine = engine_config_for(header, logs.core, str(again / "unused.tlog"))
        arrivals = [(t, logs.requests[a.request_id]) for t, a in logs.arrivals]
        trio.run(rerun_fleet, arrivals, router_config, engine, again, logs.deadline_after, logs.followups,
                 clock=trio.testing.MockClock(autojump_threshold=0))
        measured = read_fleet(again).original
    return measured, "virtual (stub replicas under trio's MockClock, the router in the same run)"
