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
from typing import Any

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
from tickloom.replay.whatif import LoggedRun, WhatIfResult, read_log
from tickloom.replay.whatif_measure import RunMetrics, measure

FIGURES = (("TTFT p50 (ms)", "ttft_ms_p50"), ("TTFT p90 (ms)", "ttft_ms_p90"),
           ("inter-token p50 (ms)", "itl_ms_p50"), ("inter-token p90 (ms)", "itl_ms_p90"),
           ("throughput (tok/s)", "throughput_tok_s"))
"""The validated figures: (row label, ``RunMetrics.summary`` key)."""


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


async def rerun(run: LoggedRun, config: EngineConfig) -> None:
    """Play ``run``'s client inputs into an engine built from ``config``, at their logged times after the first
    arrival (see the module docstring); returns once every request has ended."""
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

    async with Engine.open(config) as engine, trio.open_nursery() as nursery:
        start = trio.current_time()
        for t, msg in run.clients:
            at = max(0, t - first) / 1e9
            if isinstance(msg, RequestArrived):
                deadline = None if msg.deadline_ns is None else max(0, msg.deadline_ns - t) / 1e9
                nursery.start_soon(submit, engine, at, msg, deadline)
            elif isinstance(msg, RequestCancelled | ClientGone):
                nursery.start_soon(follow, engine, at + 1e-9, msg.request_id)
            elif isinstance(msg, Shutdown):
                raise ValidateError("--validate: the log ends requests with a shutdown, which a re-run cannot play")


def run_for_real(path: str | os.PathLike[str], run: LoggedRun, config: CoreConfig) -> tuple[RunMetrics, str]:
    """Re-run the log at ``path`` (read as ``run``) under ``config``; its measured figures and the clock it ran on."""
    with LogReader(path) as reader:
        header = reader.header
    stub = run.setting is not None and run.setting.is_stub
    with tempfile.TemporaryDirectory(prefix="tickloom-validate-") as tmp:
        log = Path(tmp) / "rerun.tlog"
        engine = engine_config_for(header, config, str(log))
        if stub:
            trio.run(rerun, run, engine, clock=trio.testing.MockClock(autojump_threshold=0))
        else:
            trio.run(rerun, run, engine)
        measured = measure(read_log(log).ticks)
    return measured, "virtual (the stub under trio's MockClock)" if stub else "real time"


@dataclasses.dataclass(slots=True)
class ValidateReport:
    """Predicted against measured (see the module docstring): two summaries (``RunMetrics.summary`` or
    ``FleetMetrics.summary``), the prediction's intervals, and how it was made."""

    predicted: dict[str, object]
    intervals: dict[str, tuple[float, float]]
    measured: dict[str, object]
    clock: str
    step_model: str
    extrapolated: bool

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for label, key in FIGURES:
            p, m = self.predicted[key], self.measured[key]
            lo, hi = self.intervals.get(key, (p, p) if isinstance(p, int | float) else (None, None))
            ratio = p / m if isinstance(p, int | float) and isinstance(m, int | float) and m else None
            out.append({"figure": label, "key": key, "predicted": p, "low": lo, "high": hi, "measured": m,
                        "ratio": ratio})
        return out

    def to_json(self) -> dict[str, object]:
        return {"clock": self.clock, "step_model": self.step_model, "extrapolated": self.extrapolated,
                "rows": self.rows()}

    def format_text(self) -> str:
        lines = [f"validate: the log's arrivals re-run for real under the what-if's configuration ({self.clock})",
                 f"{'':22} {'predicted':>10} {'interval':>19} {'measured':>10} {'ratio':>7}"]
        for row in self.rows():
            interval = "-" if row["low"] is None else f"{_num(row['low'])}-{_num(row['high'])}"
            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            lines.append(f"{row['figure']:22} {_num(row['predicted']):>10} {interval:>19} "
                         f"{_num(row['measured']):>10} {ratio:>7}")
        if self.extrapolated:
            lines.append("(the prediction extrapolates beyond its step model's range: see the notes)")
        return "\n".join(lines)


def _num(value: object) -> str:
    if not isinstance(value, int | float) or math.isnan(value):
        return "-"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}"


def validate(path: str | os.PathLike[str], prediction: WhatIfResult, run: LoggedRun) -> ValidateReport:
    """Re-run the log for real under ``prediction``'s configuration and line the figures up (``ValidateError``)."""
    measured, clock = run_for_real(path, run, prediction.config)
    return ValidateReport(prediction.whatif.summary(), prediction.intervals, measured.summary(), clock,
                          prediction.model.source, prediction.extrapolated)


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
