"""The race explorer's core level: the real ``SchedulerCore`` in the simulator, each completion moved to another tick.

One seed is one run, reproducible byte for byte:

* **The workload** (``Workload``): a core configuration and a client script of ``Arrive`` (with the oracle's scripted
  tokens, e.g. an EOS at an index), ``Leave`` (a cancel or a disconnect, delivered through the simulator as a
  client completion) and ``StopAt`` (the retire actor reports a stop-string match once that token index is
  streamed) actions. ``random_workload(seed)`` draws clients like the C26 blast's (shared prefixes, cache salts,
  priorities, deadlines, stop token ids, EOS, cancels, ``ClientGone``, ``StopMatched``) under a small random
  configuration; ``log_workload(path)`` takes a real log's arrivals, client inputs, stop matches, streamed tokens
  and configuration.
* **The schedule** (``tools.explore.core_schedule``): every question the simulator asks (``replay.policy``)
  answered by a strategy from ``random.Random`` seeded by (seed, strategy, faults); once the script's last action
  has passed, the faults heal and every answer is prompt.
* **Moved events**: each answer that differs from the prompt default (``replay.policy.Policy``) is an *edit*
  (``Decision``). A run re-played from its edits alone, the default answering the rest, is the same run; fewer
  edits are fewer moved events (that is how the driver, ``tools.explore.driver``, shrinks).

The checks (``tools.explore.checks``), after every tick: ``core.check_invariants()``; the clients' view
(``ClientCheck``: one finish per request, no token after it, indices in order, streamed tokens equal to the finish's
count unless a stop match truncated it, a ``StopMatched`` delivered while the request was live caps the count at its
index + 1, no request live after a tick at or past its deadline); no swapped sequence stranded while the free and
cached blocks would fit it (``StrandCheck``); at the end, liveness (every request ended within ``drain_bound`` ticks
of the last action) and conservation (every block free or cached, nothing held). With a log, it must replay
``identical``. The kept log of a violation shows it again on the variant: ``replay --bisect`` names an invariant's
tick (with ``StrandCheck``, a stranding's), and the clients' check on the log finds a client-visible one
(``CoreLevel.check_kept_log``).

Nothing here needs trio.
"""

from __future__ import annotations

import dataclasses
import random
import traceback
from collections.abc import Iterable, Sequence
from pathlib import Path

from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.engine.core.errors import InvariantViolation
from tickloom.events import (
    ClientGone,
    EmitTokens,
    Input,
    LogReader,
    LogWriter,
    RequestArrived,
    RequestCancelled,
    SamplingSpec,
    StopMatched,
    TickInputs,
    TickOutputs,
)
from tickloom.replay.header import core_config_from_header
from tickloom.replay.oracle import OracleExecutor
from tickloom.replay.policy import Decision, Policy
from tickloom.replay.record import header_for
from tickloom.replay.sim import Simulator
from tickloom.replay.verify import bisect, verify
from tickloom.tools.explore.checks import ClientCheck, StrandCheck, Violation, check_client_log, check_end
from tickloom.tools.explore.core_schedule import ExplorePolicy, default_policy, strategy_policy
from tickloom.tools.explore.driver import Run, Schedule

LEVEL = "core"
EOS = 1
STOP_TOKEN = 2
VOCAB = 1000
STRAND_TICKS = 3
"""Ticks a ready swapped sequence may stay parked while the free and cached blocks would fit it (0 in the real core:
``swap_in`` runs at the end of every tick)."""


# -- workloads -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Arrive:
    tick: int
    msg: RequestArrived
    tokens: tuple[tuple[int, int], ...] = ()
    """The oracle's scripted (output index, token) pairs for this request."""


@dataclasses.dataclass(frozen=True, slots=True)
class Leave:
    tick: int
    msg: RequestCancelled | ClientGone


@dataclasses.dataclass(frozen=True, slots=True)
class StopAt:
    tick: int
    request_id: str
    index: int


Action = Arrive | Leave | StopAt


def describe_action(action: Action) -> str:
    """One line for a report: what the client (or the retire actor) does, and when."""
    if isinstance(action, Leave):
        return f"tick {action.tick}: {type(action.msg).__name__}({action.msg.request_id})"
    if isinstance(action, StopAt):
        return f"tick {action.tick}+: {action.request_id} matches a stop string at token index {action.index}"
    msg, params = action.msg, action.msg.params
    parts = [f"tick {action.tick}: {msg.request_id} arrives, prompt {len(msg.prompt_token_ids)} tokens, "
             f"max_tokens {params.max_tokens}"]
    parts += [f"min_tokens {params.min_tokens}"] if params.min_tokens else []
    parts += [f"stop ids {params.stop_token_ids}"] if params.stop_token_ids else []
    parts += ["ignore_eos"] if params.ignore_eos else []
    parts += [f"priority {msg.priority}"] if msg.priority else []
    parts += [f"deadline {msg.deadline_ns / 1e6:g} ms"] if msg.deadline_ns is not None else []
    parts += [f"salt {msg.cache_salt!r}"] if msg.cache_salt else []
    parts += [f"tokens {dict(action.tokens)}"] if action.tokens and len(action.tokens) <= 3 else []
    parts += [f"{len(action.tokens)} scripted tokens"] if len(action.tokens) > 3 else []
    return ", ".join(parts)


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    config: CoreConfig
    actions: tuple[Action, ...]

    def subset(self, keep: Iterable[int]) -> Workload:
        return Workload(self.config, tuple(self.actions[i] for i in sorted(keep)))


def random_config(rng: random.Random) -> CoreConfig:
    """A small configuration under KV pressure: few blocks, tight budgets, spill and prefix caching mostly on."""
    block_size = rng.choice((4, 8, 16))
    min_blocks = 96 // block_size + 1
    return CoreConfig(
        num_blocks=rng.randint(min_blocks, min_blocks + min_blocks // 3), block_size=block_size,
        max_batch_size=rng.choice((2, 3, 4, 6)), max_seq_len=96, max_prefill_tokens=rng.choice((16, 32, 64)),
        max_batch_tokens=rng.choice((24, 64, 128)), admit_watermark=rng.choice((0, 2, 8)),
        pipeline_depth=rng.choice((1, 2, 2)), spill_enabled=rng.random() < 0.7,
        preempt_immunity_tokens=rng.choice((0, 2, 8)), eos_token_ids=(EOS,), vocab_size=VOCAB,
        prefix_caching=rng.random() < 0.85, max_waiting=rng.choice((4, 16)),
    )


def random_workload(seed: int) -> Workload:
    """Seeded random clients, like the C26 blast's, under a random small configuration."""
    rng = random.Random(f"workload:{seed}")
    config = random_config(rng)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(48)] for _ in range(2)]
    actions: list[Action] = []
    tick = 0
    for i in range(rng.randint(4, 12)):
        tick += rng.choice((0, 0, 1, 1, 2, 4))
        rid = f"q{i}"
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes)[: rng.choice((8, 16, 17, 32, 48))]
            prompt = prompt + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 8))]
        else:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.choice((1, 5, 9, 16, 23)))]
        max_tokens = rng.choice((1, 2, 4, 8, 16, 24, 32))
        params = SamplingSpec(max_tokens=max_tokens, min_tokens=rng.choice((0, 0, 2)) if max_tokens >= 2 else 0,
                              stop_token_ids=[STOP_TOKEN] if rng.random() < 0.3 else [],
                              ignore_eos=rng.random() < 0.1)
        deadline = (tick + rng.randint(4, 60)) * 1_000_000 if rng.random() < 0.4 else None
        tokens = ((rng.randrange(max_tokens), rng.choice((EOS, STOP_TOKEN))),) if rng.random() < 0.25 else ()
        msg = RequestArrived(rid, prompt, params, seed=rng.randrange(1 << 40), priority=rng.choice((0, 0, 1, -1)),
                             deadline_ns=deadline, cache_salt=rng.choice(("", "", "b")))
        actions.append(Arrive(tick, msg, tokens))
        if max_tokens >= 2 and rng.random() < 0.2:
            actions.append(StopAt(tick, rid, rng.randrange(max_tokens - 1)))
        if rng.random() < 0.12:
            leave = RequestCancelled(rid) if rng.random() < 0.6 else ClientGone(rid)
            actions.append(Leave(tick + rng.randint(0, 12), leave))
    actions.sort(key=lambda a: a.tick)  # stable: a request's stop right after its arrival
    return Workload(config, tuple(actions))


def log_workload(path: str | Path) -> Workload:
    """A real log's workload: its configuration, arrivals, cancels, disconnects and stop matches at their ticks,
    and each request's streamed tokens as the oracle's script (so the explored runs see the logged model's tokens).
    Raises ``events.LogError`` for a log that cannot be read and ``ReplayConfigError`` for a bad configuration."""
    actions: list[Action] = []
    arrivals: dict[str, tuple[int, RequestArrived]] = {}
    tokens: dict[str, dict[int, int]] = {}
    with LogReader(path) as reader:
        config = core_config_from_header(reader.header)
        for record in reader.ticks():
            tick = record.inputs.tick
            for msg in record.inputs.inputs:
                if isinstance(msg, RequestArrived):
                    arrivals[msg.request_id] = (len(actions), msg)
                    actions.append(Arrive(tick, msg))
                elif isinstance(msg, RequestCancelled | ClientGone):
                    actions.append(Leave(tick, msg))
                elif isinstance(msg, StopMatched):
                    actions.append(StopAt(tick, msg.request_id, msg.token_index))
            for command in record.outputs.commands:
                if isinstance(command, EmitTokens):
                    for rid, token, index in zip(command.request_ids, command.token_ids, command.token_indices,
                                                 strict=True):
                        tokens.setdefault(rid, {})[index] = token
    for rid, (i, msg) in arrivals.items():
        first = actions[i]
        assert isinstance(first, Arrive)
        actions[i] = Arrive(first.tick, msg, tuple(sorted(tokens.get(rid, {}).items())))
    return Workload(config, tuple(actions))


def drain_bound(workload: Workload) -> int:
    """Ticks after the script's last action within which every request must have ended (faults healed): each
    request's prefill chunks and tokens one after another, with room for swaps and the slowest I/O."""
    config = workload.config
    work = sum(len(a.msg.prompt_token_ids) // config.max_prefill_tokens + a.msg.params.max_tokens + 8
               for a in workload.actions if isinstance(a, Arrive))
    return 200 + 4 * work


# -- one run -----------------------------------------------------------------------------------------------------------
class _Sim(Simulator):
    """The simulator, keeping the last tick's inputs for the clients' check (``keep`` would keep them all)."""

    last: TickInputs = TickInputs(0, 0, [])

    def run_core(self, inputs: list[Input]) -> tuple[TickInputs, TickOutputs]:
        tick_inputs, out = super().run_core(inputs)
        self.last = tick_inputs
        return tick_inputs, out


def run_workload(workload: Workload, policy: Policy, *, replay: Sequence[Decision] = (),
                 log: Path | None = None) -> Run:
    """Run ``workload`` on the core as built now (a variant, if one is enabled) under ``policy``, answering first
    from ``replay``; check every tick, stop at the first violation. With ``log``, write the run there (the file must
    not exist) and check that it replays ``identical``."""
    config = workload.config
    scripted = {a.msg.request_id: dict(a.tokens) for a in workload.actions if isinstance(a, Arrive) and a.tokens}
    oracle = OracleExecutor(config.vocab_size, avoid=(*config.eos_token_ids, STOP_TOKEN), scripted=scripted)
    stop_at = {a.request_id: a.index for a in workload.actions if isinstance(a, StopAt)}
    writer = LogWriter(log, header_for(config, engine_version=f"tickloom-explore/{LEVEL}")) if log else None
    sim = _Sim(SchedulerCore(config), oracle, policy, check_invariants=True, check_clients=False, keep=False,
               writer=writer, stop_at=stop_at, replay=replay)
    try:
        violation = _drive(sim, workload, policy)
    finally:
        if writer is not None:
            writer.close()
    if violation is None and log is not None:
        report = verify(log)
        if report.status != "identical":
            tick = report.first_divergent_tick if report.first_divergent_tick is not None else -1
            violation = Violation("replay", tick, f"the run's log replays {report.status}: {report.error}")
    edits: list[Decision] = []
    if isinstance(policy, ExplorePolicy) and sim.decisions is not None:
        if len(policy.deviated) != len(sim.decisions):
            raise RuntimeError(f"{len(sim.decisions)} decisions but {len(policy.deviated)} answers noted")
        edits = [d for d, moved in zip(sim.decisions, policy.deviated, strict=True) if moved]
    return Run(violation, sim.tick, edits)


def _drive(sim: _Sim, workload: Workload, policy: Policy) -> Violation | None:
    by_tick: dict[int, list[Action]] = {}
    for action in workload.actions:
        by_tick.setdefault(action.tick, []).append(action)
    last = max(by_tick, default=0)
    bound = last + drain_bound(workload)
    clients = ClientCheck()
    strand = StrandCheck(STRAND_TICKS)
    idle = 0
    while True:
        tick = sim.tick
        if tick > last:
            if isinstance(policy, ExplorePolicy):
                policy.healed = True
            if not (sim.busy or sim.deadlines.watched):
                # Idle. A live request now waits for nothing but the core: a few empty ticks give a parked one
                # its chance (and ``StrandCheck`` its evidence, in the log too) before the end checks.
                idle += 1
                if not clients.live or idle > STRAND_TICKS + 1:
                    break
            if tick > bound:
                return Violation("liveness", tick, f"still busy {bound - last} ticks after the script's last action "
                                 f"(tick {last}), with {sorted(clients.live)} live")
        arrivals: list[Input] = []
        for action in by_tick.get(tick, ()):
            if isinstance(action, Arrive):
                arrivals.append(action.msg)
            elif isinstance(action, Leave):
                sim.send(action.msg)
        try:
            out = sim.step(*arrivals)
        except InvariantViolation as exc:
            return Violation("invariant", tick, str(exc))
        except Exception as exc:  # the core (or the oracle checking its commands) failed: reported, not hidden
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{Path(frame.filename).name}:{frame.lineno}"
            return Violation("crash", tick, f"{type(exc).__name__}: {exc} (at {where})")
        violation = clients.observe(sim.last, out)
        if violation is not None:
            return violation
        try:
            strand(sim.core)
        except InvariantViolation as exc:
            return Violation("stranded", tick, exc.detail)
    return check_end(sim.core, clients.live, sim.tick)


def default_run(workload: Workload, edits: Sequence[Decision] = (), *, log: Path | None = None) -> Run:
    """The run that ``edits`` (moved events) describe: answered from them, the prompt default answering the rest."""
    return run_workload(workload, default_policy(workload.config), replay=edits, log=log)


# -- the level, as the driver calls it -------------------------------------------------------------------------------
CLIENT_KINDS = frozenset({"ending", "order", "overrun", "stop", "deadline"})
"""The violations ``ClientCheck`` finds, which a written log shows too."""


class CoreLevel:
    """The core level: ``tools.explore.driver.Level`` over ``Workload``s."""

    name = LEVEL
    sample_every = 100
    moves_events = True
    ordered_actions = True

    def subject(self, seed: int, faults: bool, source: str | None) -> Workload:
        return log_workload(source) if source is not None else random_workload(seed)

    def run(self, subject: Workload, schedule: Schedule, log: Path, *, check_replay: bool) -> Run:
        policy = strategy_policy(schedule.seed, schedule.strategy, schedule.faults, subject.config)
        return run_workload(subject, policy, log=log if check_replay else None)

    def rerun(self, subject: Workload, schedule: Schedule, edits: Sequence[Decision], log: Path, *,
              check_replay: bool) -> Run:
        return default_run(subject, edits, log=log if check_replay else None)

    def check_kept_log(self, path: Path, kind: str) -> str:
        """It replays ``identical``; ``replay.bisect`` names the violating tick (invariants; with ``StrandCheck``,
        stranding); ``check_client_log`` finds a client-visible violation."""
        report = verify(path)
        replays = f"replay: {report.status}"
        if kind == "invariant" or kind == "stranded":
            if kind == "stranded":
                how, bisected = "replay.bisect(log, StrandCheck)", bisect(path, StrandCheck(STRAND_TICKS))
            else:
                how, bisected = "replay --bisect", bisect(path)
            return f"{replays}; {how}: {bisected.status} at tick {bisected.first_divergent_tick}: {bisected.error}"
        if kind in CLIENT_KINDS:
            return f"{replays}; the clients' check on the log: {check_client_log(path)}"
        return f"{replays} (the {kind} check reads the run's end state)"

    def describe_action(self, action: Action) -> str:
        return describe_action(action)

    def describe_edit(self, edit: Decision) -> str:
        """One moved event, in words (the default answer is the prompt one: see ``default_policy``)."""
        what, key, value = edit.what, edit.key, edit.value
        if what == "device_steps":
            return f"tick {key[0]}: the device completes {value} steps (default 1)"
        if what == "delay":
            return f"{'/'.join(map(str, key))} delivered {value} ticks late"
        if what == "step_fails":
            return f"step {key[1]} fails"
        if what in ("spill_ok", "swap_in"):
            return f"{'/'.join(map(str, key))} fails"
        if what == "deadline_due":
            return f"tick {key[1]}: the deadline of {key[0]} is {'reported early' if value else 'not reported yet'}"
        return f"tick {key[0]}: {what} order {value!r}"


CORE = CoreLevel()
"""The core level."""
