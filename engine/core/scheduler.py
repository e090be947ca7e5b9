"""``SchedulerCore``: the pure state machine at the heart of tickloom.

``tick(TickInputs) -> TickOutputs`` is the only way in. It reads no clock (time arrives as ``now_ns``), does no
I/O and draws no randomness, so the same inputs always give byte-identical outputs. One tick runs these phases,
in the reference scheduler's order (ARCHITECTURE.md, "The tick"); each is a function named after what it does:

1. ``apply_inputs``: arrivals, cancellations, step results, spill and swap-in completions, stop matches,
   deadline notices, shutdown;
2. ``sweep_deadlines``: the reference scheduler sweeps at the end of the tick, after planning, so a request
   already past its deadline was admitted and given a row (a wasted prefill, and blocks a live head could not
   have). Here it runs before admission. Nothing between it and retirement commits a token or reads the clock,
   so it times out the same requests, at the same token, as the reference scheduler's sweep; they are merely
   never planned;
3. ``admit``: the KV gate, FCFS by (priority, arrival);
4. ``plan_step``: decode rows, prefill chunks, KV exhaustion;
5. ``take_finished``, ``retire_finished``, ``swap_in``, ``resume_preempted``, then the planned ``RunStep`` is
   emitted last.

In the steady state most steps are planned by ``decode_lane.plan_lane_decode``, which derives the decode rows from
the previous step's in bulk; ``planner`` is the general plan and the specification it must match.
"""

from __future__ import annotations

from tickloom.engine.core.admission import admit
from tickloom.engine.core.apply import apply_inputs
from tickloom.engine.core.config import CoreConfig
from tickloom.engine.core.context import TickContext
from tickloom.engine.core.deadlines import compact_deadlines, sweep_deadlines
from tickloom.engine.core.errors import InvariantViolation
from tickloom.engine.core.invariants import check_invariants
from tickloom.engine.core.planner import plan_step
from tickloom.engine.core.snapshot import CoreSnapshot, restore_state, take_snapshot
from tickloom.engine.core.state import CoreState
from tickloom.engine.core.tick_end import resume_preempted, retire_finished, swap_in, take_finished
from tickloom.events import CoreGauges, TickInputs, TickOutputs, chain_digest, encode_commands


class SchedulerCore:
    """Every scheduling decision of the engine. Sans-I/O: feed ``TickInputs`` in, act on the commands out."""

    def __init__(self, config: CoreConfig) -> None:
        self.state = CoreState.create(config)
        self.last_encoded_commands = b""
        """The msgpack of the last tick's commands, which the digest hashed; the log writer reuses it."""

    @property
    def config(self) -> CoreConfig:
        return self.state.config

    def tick(self, tick_inputs: TickInputs) -> TickOutputs:
        """Run one tick. Raises ``InvariantViolation`` if an input contradicts the core's state."""
        state = self.state
        if tick_inputs.tick != state.tick + 1:
            raise InvariantViolation("ticks are consecutive", f"tick {tick_inputs.tick} after tick {state.tick}")
        if tick_inputs.now_ns < state.now_ns:
            raise InvariantViolation("time never goes back", f"now_ns {tick_inputs.now_ns} < {state.now_ns}")
        state.tick = tick_inputs.tick
        state.now_ns = tick_inputs.now_ns
        ctx = TickContext()

        apply_inputs(state, ctx, tick_inputs.inputs)
        sweep_deadlines(state)
        admit(state, ctx)
        step = plan_step(state, ctx)
        retire_finished(state, ctx, take_finished(state))
        swap_in(state, ctx)
        resume_preempted(state, ctx)
        compact_deadlines(state)
        if step is not None:
            ctx.commands.append(step)
        ctx.commands += ctx.releases

        gauges = self.gauges()
        encoded = encode_commands(ctx.commands)
        state.digest = chain_digest(state.digest, encoded, gauges)
        self.last_encoded_commands = encoded
        return TickOutputs(state.tick, ctx.commands, self._needs_tick(ctx), gauges, state.digest)

    def _needs_tick(self, ctx: TickContext) -> bool:
        """Whether another tick would make progress without any new input.

        Two cases: the pipeline has room for a step fed from the one just planned (running ahead), or nothing
        is in flight and this tick changed something parked work was waiting for. Never true when the next
        tick could do nothing, so an idle engine never spins.
        """
        state = self.state
        if state.shut_down:
            return False
        if ctx.planned_step and len(state.steps) < state.config.pipeline_depth:
            return True
        return not state.steps and ctx.unblocked and bool(state.running or state.waiting or state.preempted)

    def gauges(self) -> CoreGauges:
        state = self.state
        return CoreGauges(
            waiting=len(state.waiting),
            running=state.active,
            preempted=len(state.preempted),
            swapped=len(state.swapping_or_swapped),
            free_blocks=state.pool.num_free,
            cached_blocks=state.pool.num_cached,
        )

    def check_invariants(self) -> None:
        """Raise ``InvariantViolation`` naming the invariant and the objects involved, if any fails."""
        check_invariants(self.state)

    def snapshot(self) -> CoreSnapshot:
        """The whole state as a msgspec Struct (a copy: later ticks do not change it)."""
        return take_snapshot(self.state)

    @classmethod
    def from_snapshot(cls, snapshot: CoreSnapshot) -> SchedulerCore:
        """A core that continues exactly where the snapshotted one was."""
        core = cls(snapshot.config)
        core.state = restore_state(snapshot)
        return core
