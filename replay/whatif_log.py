"""The log, read once, for a what-if (``replay.whatif``): its configuration and model setting, its ticks, every token
it committed, its step samples for the step-time model, and when each completion and client input came."""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter, defaultdict

from tickloom.engine.core import CoreConfig
from tickloom.events import (
    ClientGone,
    DeadlineReached,
    EmitTokens,
    Finish,
    Input,
    LogReader,
    RequestArrived,
    RequestCancelled,
    RunStep,
    Shutdown,
    SpillDone,
    StepDone,
    StepFailed,
    StopMatched,
    SwapInFailed,
    SwapInReady,
    TickInputs,
    TickOutputs,
)
from tickloom.replay.header import core_config_from_header
from tickloom.replay.policy import Key
from tickloom.replay.step_model import StepSample, StepShape
from tickloom.replay.whatif_measure import Tick
from tickloom.replay.whatif_model import LogSetting

CLIENT_INPUTS = (RequestArrived, RequestCancelled, ClientGone, Shutdown)


@dataclasses.dataclass(slots=True)
class LoggedRun:
    """What a what-if takes from a log."""

    config: CoreConfig
    setting: LogSetting | None = None
    """What the header says about the model that wrote the log."""
    ticks: list[Tick] = dataclasses.field(default_factory=list)
    tokens: dict[str, dict[int, int]] = dataclasses.field(default_factory=lambda: defaultdict(dict))
    """request -> {output index: the token the log committed there}."""
    logprobs: dict[str, dict[int, float]] = dataclasses.field(default_factory=lambda: defaultdict(dict))
    step_rows: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)
    """(step, request) -> the token that logged step result carried (the rows the log never committed, too)."""
    clients: list[tuple[int, Input]] = dataclasses.field(default_factory=list)
    """(now_ns, input) of every client input, in log order (a graceful ``Shutdown`` is left out)."""
    graceful_shutdown: Shutdown | None = None
    """A logged ``Shutdown`` that ended nothing (delivered once the modelled run drains)."""
    stops: dict[str, int] = dataclasses.field(default_factory=dict)
    """request -> the output index of its first logged stop-string match."""
    samples: list[StepSample] = dataclasses.field(default_factory=list)
    latencies: list[int] = dataclasses.field(default_factory=list)
    """Every step's latency as the core saw it (``StepSample``), measured time or not."""
    last_result_ns: int = 0
    results_at: Counter[int] = dataclasses.field(default_factory=Counter)
    """tick -> step results delivered in it."""
    delivered: dict[Key, int] = dataclasses.field(default_factory=dict)
    """A completion's simulator key (``("spill", r, n)``, ``("swap_in", r, n)``, ``("stop", r, k)``) -> its tick."""
    spill_ok: dict[str, list[bool]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    swap_in_ok: dict[str, list[bool]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    deadlines: set[tuple[int, str]] = dataclasses.field(default_factory=set)
    failed_steps: set[int] = dataclasses.field(default_factory=set)


def read_log(path: str | os.PathLike[str]) -> LoggedRun:
    """Read ``path`` (raises ``LogError`` if it cannot be read, ``ReplayConfigError`` for a bad configuration)."""
    with LogReader(path) as reader:
        run = LoggedRun(core_config_from_header(reader.header), LogSetting.of(reader.header))
        steps: dict[int, tuple[StepShape, int]] = {}
        for record in reader.ticks():
            _read_tick(run, record.inputs, record.outputs, steps)
    return run


def _read_tick(run: LoggedRun, inputs: TickInputs, outputs: TickOutputs,
               steps: dict[int, tuple[StepShape, int]]) -> None:
    """Take one logged tick in. ``steps``: step -> (shape, dispatched at), until its result comes."""
    tick, now = inputs.tick, inputs.now_ns
    run.ticks.append((inputs, outputs))
    for msg in inputs.inputs:
        if isinstance(msg, StepDone | StepFailed):
            run.results_at[tick] += 1
            shape = steps.pop(msg.step_id, None)
            if shape is not None and isinstance(msg, StepDone):
                start = max(shape[1], run.last_result_ns)
                run.samples.append(StepSample(shape[0], msg.step_time_ns, now - start))
                run.latencies.append(now - start)
            run.last_result_ns = now
        if isinstance(msg, StepDone):
            run.step_rows.update(((msg.step_id, r), t) for r, t in zip(msg.request_ids, msg.token_ids, strict=True))
        elif isinstance(msg, StepFailed):
            run.failed_steps.add(msg.step_id)
        elif isinstance(msg, SpillDone):
            run.delivered[("spill", msg.request_id, len(run.spill_ok[msg.request_id]))] = tick
            run.spill_ok[msg.request_id].append(msg.ok)
        elif isinstance(msg, SwapInReady | SwapInFailed):
            run.delivered[("swap_in", msg.request_id, len(run.swap_in_ok[msg.request_id]))] = tick
            run.swap_in_ok[msg.request_id].append(isinstance(msg, SwapInReady))
        elif isinstance(msg, StopMatched):
            run.delivered[("stop", msg.request_id, msg.token_index)] = tick
            run.stops.setdefault(msg.request_id, msg.token_index)
        elif isinstance(msg, DeadlineReached):
            run.deadlines.add((tick, msg.request_id))
        elif isinstance(msg, Shutdown) and not any(isinstance(c, Finish) for c in outputs.commands):
            run.graceful_shutdown = msg
        elif isinstance(msg, CLIENT_INPUTS):
            run.clients.append((inputs.now_ns, msg))
    for command in outputs.commands:
        if isinstance(command, RunStep):
            steps[command.step_id] = (StepShape.of(command), now)
        elif isinstance(command, EmitTokens):
            for i, (rid, token, index) in enumerate(
                zip(command.request_ids, command.token_ids, command.token_indices, strict=True)
            ):
                run.tokens[rid].setdefault(index, token)
                if command.logprobs is not None and not math.isnan(command.logprobs[i]):
                    run.logprobs[rid].setdefault(index, command.logprobs[i])
