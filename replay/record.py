"""Record a log by driving a ``SchedulerCore`` with a scripted workload (a ``Scenario``): the engine's stand-in for
tests, benches and what-if runs. The workloads themselves live with their users: the tests' fixed ones in
``tests/scenarios.py``, ``bench replay``'s in ``tools/bench/replay.py``.

``record_core_run`` is the simulator (``replay/sim.py``) under a fixed policy, playing every actor as the engine
does: the device (any ``Device``, e.g. ``OracleExecutor``, run in command order like the device thread's FIFO), the
spill store (``SpillDone`` once the device has run the ``SpillOut``), the swap-in prefetcher (``SwapInReady``), the
deadline actor (``DeadlineReached`` once ``now_ns`` reaches a watched deadline) and the retire actor (a
``StopMatched`` when a scripted stop index is streamed). It writes the log exactly as the engine will: a header whose
``config_json`` holds the core configuration under ``"core"``, one frame per tick with the core's encoded commands,
and a snapshot after every ``snapshot_every`` ticks.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping, Sequence

from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.events import (
    DIGEST_VERSION,
    FORMAT_VERSION,
    SCHEMA_HASH,
    Input,
    LogHeader,
    LogWriter,
    RequestArrived,
    RunStep,
    SamplingSpec,
    TickInputs,
    TickOutputs,
)
from tickloom.events.routing import Actor, routed_to
from tickloom.replay.oracle import OracleExecutor
from tickloom.replay.policy import Policy
from tickloom.replay.sim import TICK_NS, Device, Simulator

__all__ = [
    "DEVICE_COMMANDS", "ENGINE_VERSION", "TICK_NS", "Device", "RecordResult", "Scenario", "arrival", "header_for",
    "record_core_run",
]

ENGINE_VERSION = "tickloom-record/0.1"
"""``engine_version`` of logs written by ``record_core_run``."""

DEVICE_COMMANDS = routed_to(Actor.DEVICE, Actor.SPILL)
"""Commands a ``Device`` that also keeps the spilled copies (``replay.full.ModelDevice``) executes, in order."""


@dataclasses.dataclass(slots=True)
class RecordResult:
    """What a recorded run did."""

    path: str
    ticks: int
    rows: int
    core: SchedulerCore
    inputs: list[TickInputs]
    outputs: list[TickOutputs]


def header_for(config: CoreConfig, *, snapshot_every: int = 0, engine_version: str = ENGINE_VERSION,
               model_fingerprint: str = "", **extra: str | int) -> LogHeader:
    """The header the engine writes for ``config``: the core configuration sits under ``"core"``."""
    config_json = json.dumps({"core": json.loads(config.to_json()), "engine": {"recorder": True}}, sort_keys=True)
    return LogHeader(
        FORMAT_VERSION,
        SCHEMA_HASH,
        DIGEST_VERSION,
        engine_version,
        config_json,
        model_fingerprint=model_fingerprint,
        snapshot_every=snapshot_every,
        **extra,  # type: ignore[arg-type]
    )


def default_device(config: CoreConfig) -> OracleExecutor:
    """The oracle for ``config``: it never produces EOS or a think marker unless scripted."""
    avoid = tuple(config.eos_token_ids) + tuple(
        t for t in (config.think_start_token, config.think_end_token) if t is not None
    )
    return OracleExecutor(config.vocab_size, avoid=avoid)


def record_core_run(
    path: str | os.PathLike[str],
    config: CoreConfig,
    script: Mapping[int, Sequence[Input]],
    *,
    device: Device | None = None,
    snapshot_every: int = 0,
    spill_fails: Iterable[str] = (),
    stop_at: Mapping[str, int] | None = None,
    device_lag: int = 0,
    steps_per_tick: int = 1,
    tick_ns: int = TICK_NS,
    max_ticks: int = 100_000,
    model_fingerprint: str = "",
    keep: bool = True,
) -> RecordResult:
    """Run ``config``'s core on ``script`` (tick -> inputs the clients send at that tick) and log every tick.

    Stops once the script is done and nothing is pending, in flight, watched or asked for. ``keep`` keeps every
    tick's inputs and outputs in the result.
    """
    core = SchedulerCore(config)
    policy = Policy(device_lag=device_lag, steps_per_tick=steps_per_tick, spill_after_device=True,
                    spill_fails=frozenset(spill_fails), report_deadlines=True)
    last_scripted = max(script, default=-1)
    result = RecordResult(os.fspath(path), 0, 0, core, [], [])
    header = header_for(config, snapshot_every=snapshot_every, model_fingerprint=model_fingerprint)
    with LogWriter(path, header) as writer:
        sim = Simulator(core, device or default_device(config), policy, check_clients=False, keep=keep,
                        writer=writer, snapshot_every=snapshot_every, stop_at=dict(stop_at or {}), tick_ns=tick_ns,
                        record_decisions=False)
        for tick in range(max_ticks):
            if tick > last_scripted and not (sim.busy or sim.deadlines.watched):
                break
            out = sim.step(*script.get(tick, ()))
            result.ticks += 1
            result.rows += sum(len(c.request_ids) for c in out.commands if isinstance(c, RunStep))
        else:
            raise RuntimeError(f"record_core_run: still busy after {max_ticks} ticks")
    result.inputs, result.outputs = sim.inputs, sim.outputs
    return result


def arrival(request_id: str, prompt_len: int, max_tokens: int, **kw: object) -> RequestArrived:
    """An arrival with a prompt of ``prompt_len`` tokens derived from the request id."""
    base = 1000 + 97 * sum(map(ord, request_id))
    prompt = [(base + 7 * i) % 400 + 100 for i in range(prompt_len)]
    seed = kw.pop("seed", sum(map(ord, request_id)))
    return RequestArrived(request_id, prompt, SamplingSpec(max_tokens=max_tokens), seed=seed, **kw)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class Scenario:
    """A workload for ``record_core_run``."""

    config: CoreConfig
    script: dict[int, list[Input]]
    spill_fails: tuple[str, ...] = ()
    stop_at: dict[str, int] = dataclasses.field(default_factory=dict)
    fail_steps: frozenset[int] = frozenset()
    scripted: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)
    device_lag: int = 0

    def device(self) -> OracleExecutor:
        avoid = tuple(self.config.eos_token_ids)
        return OracleExecutor(self.config.vocab_size, avoid=avoid, scripted=dict(self.scripted),
                              fail_steps=self.fail_steps)

    def record(self, path: str | os.PathLike[str], *, snapshot_every: int = 0, device: Device | None = None,
               keep: bool = True) -> RecordResult:
        return record_core_run(path, self.config, self.script, device=device or self.device(),
                               snapshot_every=snapshot_every, spill_fails=self.spill_fails, stop_at=self.stop_at,
                               device_lag=self.device_lag, keep=keep)
