"""Fleet what-if: a router log's arrivals re-routed under another policy or replica count (``tickloom whatif``).

The arrivals come from the router log, at its times (the front end's clock). Each request's ``RequestArrived`` (its
prompt, sampling, seed) and its tokens come from the replica logs that served it, all incarnations included. Each
replica is the core-level simulator of ``replay.whatif``'s modelled mode: the real ``SchedulerCore`` with the
replicas' configuration, a ``LoggedTokenDevice`` answering each output index with the logged token (the oracle past
what the log has, e.g. for a request its replica's death cut short), and step times from one ``StepModel``, chosen
as an engine log's what-if chooses it (``replay.whatif_model``: the stub's exact clock for a stub fleet, else the fit
of every replica log's measured steps, or the model's calibration profile where they do not cover the what-if's),
with the share of steps outside its range reported as an extrapolation and an interval around each figure from
runs on the model's residuals. The router is the real ``Router`` with the what-if configuration; before each
arrival every simulated replica runs up to the arrival's time, and the router gets each one's load (its core's
waiting, running and free blocks) and the requests finished since, as the live fleet's watcher would report them.

Both columns use one set of definitions: the prefix-cache hit rate is cached prompt tokens over prompt tokens of the
finished requests (their ``Finish`` usage); latencies are ``replay.whatif_measure.measure``'s, per replica (each
replica log has its own clock), merged; throughput is completion tokens over the span from the first arrival to the
last finished request, on the router's clock. Approximations: step times are modelled, load reports are exact and
instant (the live fleet polls them), and replicas never die in the what-if.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec

from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.events import (
    ClientGone,
    Finish,
    Input,
    RequestArrived,
    RequestCancelled,
    RunStep,
    TickInputs,
    TickOutputs,
)
from tickloom.fleet.logged_router import LoggedRouter
from tickloom.fleet.router_events import Arrival, Finished, LoadReport, Route, RouterConfig
from tickloom.fleet.router_log import RouterLogReader
from tickloom.fleet.router_replay import ROUTER_LOG, replica_logs
from tickloom.replay.header import ReplayConfigError
from tickloom.replay.sim import Simulator
from tickloom.replay.step_model import StepModel, StepSample
from tickloom.replay.whatif import LoggedTokenDevice, ModelTiming, read_log
from tickloom.replay.whatif_measure import intervals, measure, percentile
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

MAX_TICKS = 2_000_000


@dataclasses.dataclass(slots=True)
class FleetMetrics:
    """One column of the table."""

    replicas: int
    policy: str
    requests: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    duration_ns: int = 0
    ttft_ns: list[int] = dataclasses.field(default_factory=list)
    itl_ns: list[int] = dataclasses.field(default_factory=list)
    per_replica: list[int] = dataclasses.field(default_factory=list)
    """Requests routed to each replica."""

    @property
    def hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def throughput(self) -> float:
        return self.completion_tokens / (self.duration_ns / 1e9) if self.duration_ns > 0 else 0.0

    def summary(self) -> dict[str, object]:
        def ms(values: list[int], q: float) -> float | None:
            p = percentile(values, q)
            return None if p is None else p / 1e6

        return {"replicas": self.replicas, "policy": self.policy, "requests": self.requests,
                "finished": self.finished, "prefix_cache_hit_rate": self.hit_rate,
                "completion_tokens": self.completion_tokens, "duration_s": self.duration_ns / 1e9,
                "throughput_tok_s": self.throughput,
                **{f"ttft_ms_p{q}": ms(self.ttft_ns, q) for q in (50, 90, 99)},
                **{f"itl_ms_p{q}": ms(self.itl_ns, q) for q in (50, 90, 99)},
                "requests_per_replica": self.per_replica}


def _add_finishes(m: FleetMetrics, ticks: list[tuple[TickInputs, TickOutputs]]) -> None:
    for _, outputs in ticks:
        for command in outputs.commands:
            if isinstance(command, Finish):
                m.finished += 1
                m.prompt_tokens += command.usage.prompt_tokens
                m.cached_prompt_tokens += command.usage.cached_prompt_tokens
    run = measure(ticks)
    m.completion_tokens += run.completion_tokens
    m.ttft_ns += run.ttft_ns
    m.itl_ns += run.itl_ns


@dataclasses.dataclass(slots=True)
class FleetLogs:
    """What the what-if takes from a fleet directory."""

    router: RouterConfig
    arrivals: list[tuple[int, Arrival]]
    """(router time, arrival), in log order."""
    routed: dict[str, int]
    last_finished_ns: int
    core: CoreConfig
    requests: dict[str, RequestArrived]
    followups: dict[str, list[tuple[int, Input]]]
    """request -> (ns after its arrival, its cancel or client-gone), as its replica log has them."""
    deadline_after: dict[str, int]
    """request -> its deadline, in ns after its arrival (each replica log has its own clock; the what-if's is the
    router's)."""
    tokens: dict[str, dict[int, int]]
    logprobs: dict[str, dict[int, float]]
    stops: dict[str, int]
    model: StepModel
    """The log's own step model (``replay.whatif_model.log_model``)."""
    original: FleetMetrics
    setting: LogSetting
    samples: list[StepSample]


def read_fleet(fleet_dir: str | os.PathLike[str]) -> FleetLogs:
    """Read a fleet directory's logs (``LogError``/``ReplayConfigError`` if one cannot be read)."""
    arrivals: list[tuple[int, Arrival]] = []
    routed: dict[str, int] = {}
    last_finished = 0
    with RouterLogReader(Path(fleet_dir) / ROUTER_LOG) as reader:
        config = reader.config
        for record in reader.router_ticks():
            now = record.inputs.now_ns
            for item in record.inputs.inputs:
                if isinstance(item, Arrival):
                    arrivals.append((now, item))
                elif isinstance(item, Finished):
                    last_finished = max(last_finished, now)
            routed.update((c.request_id, c.replica) for c in record.outputs.commands if isinstance(c, Route))
    logs = replica_logs(fleet_dir)
    if not logs:
        raise ReplayConfigError(f"{os.fspath(fleet_dir)}: no replica logs")
    runs = [read_log(path) for _, _, path in logs]
    original = FleetMetrics(config.replicas, config.policy, requests=len(arrivals),
                            per_replica=[sum(r == i for r in routed.values()) for i in range(config.replicas)])
    requests: dict[str, RequestArrived] = {}
    followups: dict[str, list[tuple[int, Input]]] = defaultdict(list)
    tokens: dict[str, dict[int, int]] = defaultdict(dict)
    logprobs: dict[str, dict[int, float]] = defaultdict(dict)
    stops: dict[str, int] = {}
    arrived_at: dict[str, int] = {}
    deadline_after: dict[str, int] = {}
    for run in runs:
        if run.config != runs[0].config:
            raise ReplayConfigError("the replica logs were written with different core configurations")
        for now, msg in run.clients:
            if isinstance(msg, RequestArrived):
                requests[msg.request_id] = msg
                arrived_at[msg.request_id] = now
                if msg.deadline_ns is not None:
                    deadline_after[msg.request_id] = msg.deadline_ns - now
            elif isinstance(msg, RequestCancelled | ClientGone) and msg.request_id in arrived_at:
                followups[msg.request_id].append((now - arrived_at[msg.request_id], msg))
        for rid, by_index in run.tokens.items():
            tokens[rid].update(by_index)
        for rid, lps in run.logprobs.items():
            logprobs[rid].update(lps)
        stops.update(run.stops)
        _add_finishes(original, run.ticks)
    first = arrivals[0][0] if arrivals else 0
    original.duration_ns = max(0, last_finished - first)
    # requests that never reached a replica (refused, or lost before submit) have no arrival to replay
    arrivals = [(t, a) for t, a in arrivals if a.request_id in requests]
    setting = runs[0].setting or LogSetting(None, None, "", "", "", 0)
    samples = [s for r in runs for s in r.samples]
    return FleetLogs(config, arrivals, routed, last_finished, runs[0].config, requests, dict(followups),
                     deadline_after, dict(tokens), dict(logprobs), stops,
                     log_model(setting, samples, [t for r in runs for t in r.latencies]), original, setting, samples)


class _Replica:
    """One simulated replica: a core, its token device and modelled timing, and its queue of client inputs."""

    def __init__(self, logs: FleetLogs, clock: StepClock) -> None:
        config = logs.core
        self.timing = ModelTiming(model=clock, spill_after_device=True, report_deadlines=True)
        avoid = tuple(config.eos_token_ids) + tuple(
            t for t in (config.think_start_token, config.think_end_token) if t is not None)
        device = LoggedTokenDevice(config.vocab_size, avoid=avoid, logged=logs.tokens,
                                   logged_logprobs=logs.logprobs, model=clock)
        self.sim = Simulator(SchedulerCore(config), device, self.timing, stop_at=dict(logs.stops),
                             record_decisions=False)
        self.timing.sim = self.sim
        self.clients: list[tuple[int, Input]] = []
        self.seen = 0
        self.idle = True

    def queue(self, at_ns: int, msg: Input) -> None:
        """A client input at ``at_ns``, which is never before this replica's next tick (``run_until`` ran it there)."""
        self.clients.append((at_ns, msg))
        self.clients.sort(key=lambda c: c[0])
        if self.idle:
            self.sim.now_ns = max(self.sim.now_ns, at_ns)
        self.idle = False

    def run_until(self, until_ns: int | None) -> None:
        """Run ticks while there is work and the next tick comes before ``until_ns`` (None: until drained).

        ``until_ns`` counts as a client input's time: the ticks are planned so that one falls exactly there, where
        the next arrival may come. (Moving a tick earlier after the fact would deliver a step's result before the
        step's modelled end.)"""
        sim = self.sim
        for _ in range(MAX_TICKS):
            if self.idle or (until_ns is not None and sim.now_ns >= until_ns):
                return
            due: list[Input] = []
            while self.clients and self.clients[0][0] <= sim.now_ns:
                due.append(self.clients.pop(0)[1])
            upcoming = [t for t in (self.clients[0][0] if self.clients else None, until_ns) if t is not None]
            self.timing.next_client_ns = min(upcoming, default=None)
            sim.step(*due)
            sim.now_ns = self.timing.next_ns
            self.idle = not (sim.busy or self.clients or sim.deadlines.watched)
        raise RuntimeError(f"fleet whatif: a replica is still busy after {MAX_TICKS} ticks")

    def finished_since(self) -> list[str]:
        outs = self.sim.outputs[self.seen :]
        self.seen = len(self.sim.outputs)
        return [c.request_id for out in outs for c in out.commands if isinstance(c, Finish)]

    def load(self, index: int) -> LoadReport:
        g = self.sim.core.gauges()
        return LoadReport(index, g.waiting, g.running, g.free_blocks)


def simulate(logs: FleetLogs, config: RouterConfig, clock: StepClock | None = None
             ) -> tuple[FleetMetrics, list[RunStep]]:
    """The what-if column: the logged arrivals through ``config``'s router and simulated replicas whose steps take
    ``clock``'s times (default: ``logs.model``'s); and every step the replicas ran."""
    now = [0]
    router = LoggedRouter(config, None, lambda: now[0])
    replicas = [_Replica(logs, clock or logs.model) for _ in range(config.replicas)]
    metrics = FleetMetrics(config.replicas, config.policy, requests=len(logs.arrivals),
                           per_replica=[0] * config.replicas)
    for t, arrival in logs.arrivals:
        for index, replica in enumerate(replicas):
            replica.run_until(t)
            for rid in replica.finished_since():
                router.finished(rid)
            router.report(replica.load(index))
        now[0] = t
        request = logs.requests[arrival.request_id]
        # hashed again: the what-if may hash more blocks (affinity_blocks) than the log did
        [decision] = [c for c in router.route(router.arrival(request.request_id, request.prompt_token_ids,
                                                             request.cache_salt)) if isinstance(c, Route)]
        metrics.per_replica[decision.replica] += 1
        replica = replicas[decision.replica]
        after = logs.deadline_after.get(request.request_id)
        replica.queue(t, request if after is None else msgspec.structs.replace(request, deadline_ns=t + after))
        for delta, msg in logs.followups.get(request.request_id, []):
            replica.queue(t + delta, msg)
    last = 0
    for replica in replicas:
        replica.run_until(None)
        ticks = list(zip(replica.sim.inputs, replica.sim.outputs, strict=True))
        _add_finishes(metrics, ticks)
        last = max([last] + [i.now_ns for i, o in ticks if any(isinstance(c, Finish) for c in o.commands)])
    metrics.duration_ns = max(0, last - logs.arrivals[0][0]) if logs.arrivals else 0
    return metrics, [step for replica in replicas for step in sim_steps(replica.sim)]


@dataclasses.dataclass(slots=True)
class FleetWhatIf:
    path: str
    changes: dict[str, tuple[object, object]]
    original: FleetMetrics
    whatif: FleetMetrics
    model: StepModel
    notes: list[str]
    intervals: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """Figure -> its (low, high) over the runs on the model's residuals (``replay.whatif_measure.intervals``)."""
    extrapolation: Extrapolation | None = None

    @property
    def extrapolated(self) -> bool:
        return self.extrapolation is not None and self.extrapolation.marked

    def to_json(self) -> dict[str, Any]:
        return {"fleet": self.path, "set": {k: {"was": a, "now": b} for k, (a, b) in self.changes.items()},
                "original": self.original.summary(), "whatif": self.whatif.summary(),
                "step_model": self.model.to_json(), "extrapolated": self.extrapolated,
                "extrapolation": None if self.extrapolation is None else self.extrapolation.to_json(),
                "intervals": {k: list(v) for k, v in self.intervals.items()}, "notes": self.notes}

    def format_text(self) -> str:
        a, b = self.original.summary(), self.whatif.summary()
        lines = [f"fleet what-if of {self.path}: " + (", ".join(f"{k} {was!r} -> {now!r}" for k, (was, now)
                                                               in self.changes.items()) or "no change"),
                 f"{'':28} {'original':>14} {'what-if':>14} {'interval':>21}"]
        for key in a:
            spread = self.intervals.get(key)
            interval = "" if spread is None else f"{_cell(spread[0])}-{_cell(spread[1])}"
            lines.append(f"{key:28} {_cell(a[key]):>14} {_cell(b[key]):>14} {interval:>21}")
        m = self.model
        lines.append(f"step model: {m.source} ({m.why}); valid for {m.describe_range()}")
        ext = self.extrapolation
        if ext is not None and self.extrapolated:
            lines.append(f"EXTRAPOLATED: {ext.outside} of the what-if's {ext.steps} steps ({ext.fraction:.0%}) lie "
                         "outside that range: the figures above are a guess")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


ROUTER_KEYS = ("replicas", "policy", "load_slack", "affinity_blocks", "cache_blocks")


def fleet_whatif(fleet_dir: str | os.PathLike[str], changes: dict[str, object], *, step_model: ModelChoice = "auto",
                 draws: int = DRAWS) -> FleetWhatIf:
    """Re-run a fleet directory's traffic with the router configuration changed by ``changes`` (``ValueError``
    naming a bad key or value, or ``step_model="calibration"`` without a stored profile)."""
    bad = sorted(set(changes) - set(ROUTER_KEYS))
    if bad:
        raise ValueError(f"a fleet what-if sets {', '.join(ROUTER_KEYS)}; not {', '.join(bad)}")
    logs = read_fleet(fleet_dir)
    config = RouterConfig.checked({**msgspec.structs.asdict(logs.router), **changes})
    diff = {k: (getattr(logs.router, k), getattr(config, k)) for k in ROUTER_KEYS
            if getattr(logs.router, k) != getattr(config, k)}
    (whatif, _), model, extrapolation = run_on_chosen_model(
        lambda clock: simulate(logs, config, clock), lambda run: run[1], logs.setting, logs.model, logs.samples,
        step_model)
    notes = [f"each replica modelled: {model.describe()}; load reports exact and instant",
             f"step model: {model.source}: {model.why}",
             "original: the logged run (latencies on each replica's clock, duration on the router's)"]
    if extrapolation.outside:
        notes.append(extrapolation.describe(model))
    point = whatif.summary()
    if model.ratios and draws:
        spread = intervals(point, [simulate(logs, config, DrawnModel(model, k))[0].summary() for k in range(draws)])
        notes.append(f"intervals: the least and most each figure came to over {draws} runs with every step's time "
                     f"scaled by one of the model's {len(model.ratios)} residual ratios")
    else:
        spread = intervals(point, [])
    lost = len(logs.routed) - logs.original.finished
    if lost > 0:
        notes.append(f"{lost} requests did not finish in the original (a replica died, or cancelled): the what-if "
                     "runs them to the end, past the logged tokens with the oracle's")
    return FleetWhatIf(os.fspath(fleet_dir), diff, logs.original, whatif, model, notes, spread, extrapolation)
