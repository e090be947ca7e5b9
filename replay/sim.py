"""The one sans-I/O simulator: a ``SchedulerCore`` with every actor around it played in memory, tick by tick.

The core tests' ``Harness``, the C26 blast, ``record_core_run`` and ``tickloom bench core`` all drive this class;
what differs between them is a ``Policy`` (``replay/policy.py``) and what they feed it. One tick, ``step(*inputs)``:

1. The deadline actor reports the watched deadlines its policy calls due (``DeadlineReached``).
2. The tick's inputs: what the actors delivered (``pending``), then the new inputs (the clients' and the deadline
   reports, in the policy's order). ``core.tick`` runs; the frame is logged if there is a log.
3. Dispatch: each command goes to its actors by the one routing table, ``events.routing.ROUTES``:

   - device: a FIFO of ``(tick dispatched, command)``; ``SpillOut`` goes there and then to the spill store;
   - spill store: ``SpillDone`` (the policy decides ok/failed), either at once or once the device has run the
     ``SpillOut`` (``Policy.spill_after_device``); ``DropSpill`` forgets the copy;
   - swap-in prefetcher: ``SwapInReady`` / ``SwapInFailed``, or no answer;
   - deadline actor: a watch table, honouring ``UnwatchDeadline`` and re-watches; a finish ends a watch too;
   - retire (the clients' view): tokens and finishes per request, checked (exactly one finish, no token after it,
     indices in order), and a ``StopMatched`` when a scripted stop index is streamed.

4. ``core.check_invariants()`` if asked.
5. The device runs the commands that have waited ``device_lag`` ticks, up to ``device_steps`` ``RunStep``\\ s (and the
   other commands around them), through the ``Device`` (``handle(commands) -> inputs``: ``OracleExecutor``, or
   ``replay.full.ModelDevice`` around a real model).
6. What is delivered in the next tick: the device's results (in FIFO order) and every scheduled completion now due,
   merged in the policy's order, become ``pending``.

Every answer of the policy is recorded in ``decisions`` (unless turned off), keyed by what it is about (a tick, a
step, the n-th spill of a request; see ``replay.policy.Key``). A simulator built with ``replay=decisions`` answers
from that list and asks its policy only about what the list lacks: an unedited list re-plays the run exactly, an
edited one (a completion's delay, a tick's order) re-plays that edit. Causality holds by construction: a completion
is scheduled only once its cause exists, for ``caused_at + 1 + delay`` with ``delay >= 0``, and the device's results
leave in FIFO order.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar, cast

from tickloom.engine.core import SchedulerCore
from tickloom.engine.core.snapshot import encode_snapshot
from tickloom.events import (
    Command,
    DeadlineReached,
    DropSpill,
    EmitTokens,
    Finish,
    Input,
    LogWriter,
    PrefetchSpill,
    RunStep,
    SnapshotRecord,
    SpillDone,
    SpillOut,
    StepDone,
    StepFailed,
    StopMatched,
    SwapInFailed,
    SwapInReady,
    TickInputs,
    TickOutputs,
    UnwatchDeadline,
    WatchDeadline,
)
from tickloom.events.routing import ROUTES, Actor
from tickloom.replay.policy import Completion, Decision, Key, Kind, Policy, Value

TICK_NS = 1_000_000
FLUSH_EVERY = 64
"""Ticks between the log writer's flushes (as the engine's log actor would)."""

V = TypeVar("V", bound=Value)


class Device(Protocol):
    """Plays the device executor: runs commands in order and returns the inputs they produce."""

    def handle(self, commands: Iterable[Command]) -> list[Input]: ...


class Deadlines:
    """The deadline actor's watch table: request -> deadline, in the order the watches began."""

    def __init__(self) -> None:
        self.watched: dict[str, int] = {}

    def watch(self, request_id: str, deadline_ns: int) -> None:
        """Start (or move) a watch; a re-watch keeps the request's place in the table."""
        self.watched[request_id] = deadline_ns

    def unwatch(self, request_id: str) -> None:
        self.watched.pop(request_id, None)


class Simulator:
    """Drives ``core`` with simulated actors; see the module docstring.

    ``check_invariants``: run ``core.check_invariants()`` after every tick. ``check_clients``: keep the clients'
    view (``tokens``, ``reasoning``, ``finishes``) and check it. ``keep``: keep every tick's ``inputs`` and
    ``outputs``. ``writer``: log every tick (and a snapshot after every ``snapshot_every`` ticks). ``stop_at``:
    request -> the output index at which the retire actor reports a stop-string match. ``record_decisions``: keep
    the policy's answers in ``decisions``. ``replay``: decisions to answer from, before asking the policy.
    """

    def __init__(
        self,
        core: SchedulerCore,
        device: Device,
        policy: Policy,
        *,
        check_invariants: bool = False,
        check_clients: bool = True,
        keep: bool = True,
        writer: LogWriter | None = None,
        snapshot_every: int = 0,
        stop_at: dict[str, int] | None = None,
        tick_ns: int = TICK_NS,
        record_decisions: bool = True,
        replay: Iterable[Decision] = (),
    ) -> None:
        self.core = core
        self.device = device
        self.policy = policy
        self.check_invariants = check_invariants
        self.check_clients = check_clients
        self.keep = keep
        self.writer = writer
        self.snapshot_every = snapshot_every
        self.stop_at = dict(stop_at or {})
        self.tick_ns = tick_ns
        self.tick = 0
        self.now_ns = 0
        self.needs_tick = False
        self.pending: list[Input] = []
        """Inputs delivered in the next tick, before that tick's new inputs (tests may append to it)."""
        self.queue: deque[tuple[int, Command]] = deque()
        """The device's FIFO: (tick dispatched, command)."""
        self.schedule: list[Completion] = []
        """Completions on their way, in the order they were scheduled."""
        self.deadlines = Deadlines()
        self.spilled: set[str] = set()
        """Requests whose spilled copy the spill store holds."""
        self.inputs: list[TickInputs] = []
        self.outputs: list[TickOutputs] = []
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.reasoning: dict[str, list[bool]] = defaultdict(list)
        self.finishes: dict[str, Finish] = {}
        self.decisions: list[Decision] | None = [] if record_decisions else None
        self.replayed: dict[tuple[str, Key], Value] = {(d.what, d.key): d.value for d in replay}
        self._seq = 0
        self._occurrences: dict[tuple[str, str | int], int] = {}

    # -- driving ---------------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Whether anything is pending, queued on the device, scheduled, or asked for by the core."""
        return bool(self.pending or self.queue or self.schedule or self.needs_tick)

    def step(self, *inputs: Input, advance_ns: int | None = None) -> TickOutputs:
        """One tick: ``pending``, then ``inputs`` and the deadline reports in the policy's order; then the actors."""
        fired = self._poll_deadlines()
        new: list[Input] = [*inputs, *fired]
        if new:
            keys = [_identity(msg) for msg in new]
            new = [new[i] for i in self._order("arrange", keys, lambda: self.policy.arrange(inputs, fired))]
        tick_inputs, out = self.run_core([*self.pending, *new])
        self.pending = []
        if self.writer is not None:
            self._log(tick_inputs, out)
        if self.keep:
            self.inputs.append(tick_inputs)
            self.outputs.append(out)
        self.needs_tick = out.needs_tick
        self._dispatch(out.commands)
        if self.check_invariants:
            self.core.check_invariants()
        device = self._run_device()
        self._deliver(device)
        self.tick += 1
        self.now_ns += self.tick_ns if advance_ns is None else advance_ns
        return out

    def run_core(self, inputs: list[Input]) -> tuple[TickInputs, TickOutputs]:
        """``core.tick`` on this tick's inputs: the one place a subclass may time (``tickloom bench core`` does)."""
        tick_inputs = TickInputs(self.tick, self.now_ns, inputs)
        return tick_inputs, self.core.tick(tick_inputs)

    def run(self, max_ticks: int = 10_000) -> None:
        """Tick until nothing is pending, in flight, scheduled or asked for."""
        for _ in range(max_ticks):
            if not self.busy:
                return
            self.step()
        raise AssertionError(f"still busy after {max_ticks} ticks")

    def send(self, msg: Input, kind: Kind = Kind.CLIENT) -> None:
        """An input from outside the core's commands (a client's cancel, a disconnect), delivered when the policy's
        ``delay`` says, from the next tick on."""
        self._schedule(msg, kind, self.tick, self._occurrence(kind.value, _subject(msg)))

    def expedite(self) -> None:
        """Deliver every scheduled completion in the next tick at the latest (a driver draining the run)."""
        for completion in self.schedule:
            completion.due = min(completion.due, self.tick + 1)

    # -- the actors ------------------------------------------------------------------------------------------
    def _dispatch(self, commands: list[Command]) -> None:
        tick = self.tick
        for command in commands:
            for actor in ROUTES[type(command)]:
                if actor is Actor.DEVICE:
                    self.queue.append((tick, command))
                elif actor is Actor.RETIRE:
                    self._retire(command)
                elif actor is Actor.SPILL:
                    if isinstance(command, SpillOut):
                        self.spilled.add(command.request_id)
                        if not self.policy.spill_after_device:
                            self._spill_done(command, tick)
                    elif isinstance(command, DropSpill):
                        self.spilled.discard(command.request_id)
                elif actor is Actor.SWAP_IN:
                    assert isinstance(command, PrefetchSpill)
                    key = self._occurrence("swap_in", command.request_id)
                    ready = self._decide("swap_in", key, lambda: self.policy.swap_in(command))  # noqa: B023
                    if ready is not None:
                        answer: Input = (SwapInReady(command.request_id) if ready
                                         else SwapInFailed(command.request_id, "checksum mismatch"))
                        self._schedule(answer, Kind.SWAP_IN, tick, key)
                elif actor is Actor.DEADLINES:
                    if isinstance(command, WatchDeadline):
                        self.deadlines.watch(command.request_id, command.deadline_ns)
                    elif isinstance(command, UnwatchDeadline):
                        self.deadlines.unwatch(command.request_id)

    def _retire(self, command: Command) -> None:
        """The clients' view: what each client received, checked; and the scripted stop-string matches."""
        if isinstance(command, EmitTokens):
            if self.check_clients:
                for rid, token, index, reasoning in zip(
                    command.request_ids, command.token_ids, command.token_indices, command.reasoning, strict=True
                ):
                    assert rid not in self.finishes, f"token for {rid} after its finish"
                    assert index == len(self.tokens[rid]), f"{rid}: token index {index} streamed out of order"
                    self.tokens[rid].append(token)
                    self.reasoning[rid].append(reasoning)
            stops = self.stop_at
            if stops:
                for rid, index in zip(command.request_ids, command.token_indices, strict=True):
                    if stops.get(rid) == index:
                        del stops[rid]
                        self._schedule(StopMatched(rid, index), Kind.STOP, self.tick, ("stop", rid, index))
        elif isinstance(command, Finish):
            if self.check_clients:
                assert command.request_id not in self.finishes, f"{command.request_id} finished twice"
                self.finishes[command.request_id] = command
            # A finished request needs no timer. The core unwatches it in the same tick anyway; this also ends a
            # watch a driver began at submit for a request the core rejected (the blast's deadline actor).
            self.deadlines.unwatch(command.request_id)

    def _spill_done(self, command: SpillOut, tick: int) -> None:
        key = self._occurrence("spill", command.request_id)
        ok = self._decide("spill_ok", key, lambda: self.policy.spill_ok(command))
        nbytes = self.policy.spill_block_bytes * len(command.block_ids)
        self._schedule(SpillDone(command.request_id, ok, "" if ok else "disk full", nbytes), Kind.SPILL, tick, key)

    def _poll_deadlines(self) -> list[DeadlineReached]:
        fired: list[DeadlineReached] = []
        watched = self.deadlines.watched
        now, tick, due = self.now_ns, self.tick, self.policy.deadline_due
        for rid, deadline in list(watched.items()):
            if self._decide("deadline_due", (rid, tick), lambda: due(rid, deadline, now)):  # noqa: B023
                del watched[rid]
                fired.append(DeadlineReached(rid, deadline))
        return fired

    def _run_device(self) -> list[Completion]:
        """The device's share of this tick: the due commands in FIFO order, up to ``device_steps`` ``RunStep``\\ s
        (every other command before the next ``RunStep`` runs too: copies and releases never wait on a step)."""
        results: list[Completion] = []
        limit = self._decide("device_steps", (self.tick,), lambda: self.policy.device_steps(self.tick))
        due = self.tick - self.policy.device_lag
        queue = self.queue
        steps = 0
        while queue and queue[0][0] <= due:
            dispatched, command = queue[0]
            if isinstance(command, RunStep):
                if steps >= limit:
                    break
                steps += 1
            queue.popleft()
            for result in self.device.handle([command]):
                if isinstance(result, StepDone | StepFailed):
                    step_id = result.step_id
                    key: Key = ("step", step_id)
                    if isinstance(result, StepDone) and self._decide(
                        "step_fails", key, lambda: self.policy.step_fails(step_id)  # noqa: B023
                    ):
                        result = StepFailed(step_id, "scripted failure")
                else:
                    key = _identity(result)
                results.append(Completion(result, Kind.DEVICE, dispatched, self._next_seq(), self.tick + 1, key))
            if isinstance(command, SpillOut) and self.policy.spill_after_device:
                self._spill_done(command, self.tick)  # the device has handed the copy over
        return results

    def _deliver(self, device: list[Completion]) -> None:
        """``pending`` for the next tick: the device's results and the scheduled completions now due."""
        upto = self.tick + 1
        due = [c for c in self.schedule if c.due <= upto]
        if due:
            self.schedule = [c for c in self.schedule if c.due > upto]
        both = [*device, *due]
        if both:
            order = self._order("merge", [c.key for c in both], lambda: self.policy.merge(device, due))
            self.pending += [both[i].input for i in order]

    def _schedule(self, msg: Input, kind: Kind, caused_at: int, key: Key) -> None:
        completion = Completion(msg, kind, caused_at, self._next_seq(), key=key)
        delay = self._decide("delay", key, lambda: self.policy.delay(completion))
        if delay < 0:
            raise ValueError(f"a negative delay ({delay}) for {key}: a completion never precedes its cause")
        completion.due = caused_at + 1 + delay
        self.schedule.append(completion)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _occurrence(self, what: str, subject: str | int) -> Key:
        """``(what, subject, n)`` for the n-th time (from 0) this run produces ``what`` for ``subject``."""
        n = self._occurrences.get((what, subject), 0)
        self._occurrences[(what, subject)] = n + 1
        return (what, subject, n)

    def _decide(self, what: str, key: Key, ask: Callable[[], V]) -> V:
        """The answer to ``what`` about ``key``: the replayed one if there is one, else the policy's; recorded."""
        replayed = self.replayed
        value = cast(V, replayed[(what, key)]) if replayed and (what, key) in replayed else ask()
        if self.decisions is not None:
            self.decisions.append(Decision(self.tick, what, key, value))
        return value

    def _order(self, what: str, keys: list[Key], ask: Callable[[], tuple[int, ...]]) -> list[int]:
        """An order of this tick's items (indices into ``keys``): the replayed one (items it does not know keep
        their relative order, after the ones it knows), else the policy's; recorded as the items' identities."""
        recorded = self.replayed.get((what, (self.tick,))) if self.replayed else None
        if isinstance(recorded, tuple):
            rank = {key: i for i, key in enumerate(recorded)}
            order = sorted(range(len(keys)), key=lambda i: rank.get(keys[i], len(rank)))
        else:
            order = list(ask())
            if sorted(order) != list(range(len(keys))):
                raise ValueError(f"{what}: {order} is not an order of {len(keys)} items")
        if self.decisions is not None:
            self.decisions.append(Decision(self.tick, what, (self.tick,), tuple(keys[i] for i in order)))
        return order

    def _log(self, tick_inputs: TickInputs, out: TickOutputs) -> None:
        writer = self.writer
        assert writer is not None
        tick = tick_inputs.tick
        writer.append_tick(tick_inputs, out, self.core.last_encoded_commands)
        if self.snapshot_every > 0 and (tick + 1) % self.snapshot_every == 0:
            writer.append_snapshot(SnapshotRecord(tick, out.digest, encode_snapshot(self.core.snapshot())))
        if tick % FLUSH_EVERY == FLUSH_EVERY - 1:
            writer.flush()

    # -- what the clients saw --------------------------------------------------------------------------------
    def commands(self, kind: type | None = None) -> list[tuple[int, Command]]:
        """(tick, command) for every command so far, optionally of one type (needs ``keep``)."""
        return [
            (out.tick, c) for out in self.outputs for c in out.commands if kind is None or isinstance(c, kind)
        ]

    def output(self, request_id: str) -> list[int]:
        """The client's tokens: what was streamed, truncated to the finish's completion count."""
        finish = self.finishes[request_id]
        return self.tokens[request_id][: finish.usage.completion_tokens]

    def reason(self, request_id: str) -> str:
        return self.finishes[request_id].reason


def _subject(msg: Input) -> str | int:
    """The request (or step) an input is about."""
    request_id: str | None = getattr(msg, "request_id", None)
    if request_id is not None:
        return request_id
    step_id: int = getattr(msg, "step_id", -1)
    return step_id


def _identity(msg: Input) -> Key:
    """A client input's or deadline report's identity within a tick: its kind and what it is about."""
    return (type(msg).__name__, _subject(msg))
