"""Deliberately broken copies of core functions and actors, for proving that the race explorer finds real races.

Each variant is a context manager that swaps one function (in the module of ``engine.core`` that calls it) or one
actor class (in ``tickloom.runtime``, the module that builds the actors) for a broken copy, and puts the real one back
on exit. The code holds no flag for them and nothing in the public API reaches them: only ``tickloom explore
--variant NAME`` (a hidden option) and the tests enable one. Each breaks one rule (ARCHITECTURE.md).

The core level (``VARIANTS["core"]``):

* ``fence``: ``retire_finished`` frees a finished row's blocks at once, even while the newest step that references
  them has not reported back (the rule ``fences.release_blocks`` keeps with a fence).
* ``preempt-unsettled``: ``ensure_blocks`` may take a victim that an unsettled step still references (the real one
  asks ``preemption.choose_victim``, which skips such rows, and ``preempt`` asserts it). The victim leaves
  through the core's own ``take_off_device``, which is ``preempt`` without that assertion.
* ``swapped-deadline``: ``sweep_deadlines`` skips swapped sequences: a request whose deadline passes while its KV is
  in the spill store is never timed out.
* ``swap-in-no-reclaim``: ``swap_in`` without its reclaim pass (``reclaim_for_swap_in``): a swapped sequence strands
  while the blocks it needs sit, unreferenced, in the prefix cache.
* ``stream-overrun``: ``_commit_in_bulk`` streams the token of a row whose sequence already finished (an over-run of
  running ahead, or a row of a cancelled request).
* ``stop-loses``: ``stop_matched`` ignores a request already marked finished in this tick, so a ``StopMatched`` at a
  lower token index loses to a ``length`` finish at a higher one (the earliest index must win).

The actor level (``VARIANTS["actors"]``; its classes are built on first use, so that the core level never imports
trio):

* ``deadline-keyerror``: the deadline actor of commit 48fbc6e. Its timer sleeps until the earliest deadline and,
  on waking, pops and reports it without asking the watch table again; an ``UnwatchDeadline`` received while it
  slept does not wake it. So a request that finished before its deadline is "reached" anyway, and
  ``del self._live[request_id]`` raises ``KeyError``: a fatal engine error.
* ``drop-overtakes-copy``: a spill actor that deletes a copy on ``DropSpill`` at once, even while the copy is still
  on its way from the device. The copy then arrives after its request ended and stays in the host tier for good.
* ``retire-before-log``: a step actor that hands a tick's ``EmitTokens``/``Finish`` to the retire actor *before*
  writing the tick's frame to the OS, breaking "acknowledged means logged".
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import ModuleType

import tickloom.engine.core.apply as apply_module
import tickloom.engine.core.planner as planner_module
import tickloom.engine.core.scheduler as scheduler_module
import tickloom.engine.core.settle as settle_module
import tickloom.engine.core.tick_end as tick_end_module
from tickloom.engine.core.context import TickContext
from tickloom.engine.core.finish import mark_finish
from tickloom.engine.core.preemption import take_off_device
from tickloom.engine.core.state import CoreState, InflightStep, Seq
from tickloom.engine.core.status import Status
from tickloom.events import (
    Command,
    DeadlineReached,
    EmitTokens,
    Finish,
    SpillDone,
    StepDone,
    StopMatched,
    UnwatchDeadline,
    WatchDeadline,
)


# -- the core level ----------------------------------------------------------------------------------------------
def release_blocks_unfenced(state: CoreState, ctx: TickContext, seq: Seq) -> None:
    """``fences.release_blocks`` without the fence: the blocks go back to the pool at once."""
    if seq.block_ids:
        state.pool.release(seq.block_ids)
        ctx.unblocked = True
    seq.block_ids = []
    seq.sent_blocks = 0


def ensure_blocks_any_victim(state: CoreState, ctx: TickContext, seq: Seq, blocks: int, step_id: int) -> bool:
    """``planner.ensure_blocks`` whose victim may be a row of an unsettled step (not of the step being planned)."""
    pool = state.pool
    while len(seq.block_ids) < blocks:
        short = blocks - len(seq.block_ids) - pool.num_free
        if short > 0:
            pool.reclaim(short)
        if pool.num_free >= blocks - len(seq.block_ids):
            seq.block_ids.extend(pool.allocate(blocks - len(seq.block_ids)))
            return True
        victim: Seq | None = None
        best: tuple[int, int, int, int] | None = None
        for other in state.running:
            if other.status is not Status.RUNNING or other.last_step == step_id:
                continue
            key = (0 if len(other.outputs) < other.immune_until else 1, other.priority, -len(other.outputs),
                   other.admitted)
            if best is None or key > best:
                victim, best = other, key
        if victim is None:
            return False
        take_off_device(state, ctx, victim)
        if victim is seq:
            return False
    return True


def sweep_deadlines_skipping_swapped(state: CoreState) -> None:
    """``deadlines.sweep_deadlines`` that passes over swapped sequences (their heap entries are dropped)."""
    heap = state.deadlines
    now = state.now_ns
    while heap and heap[0][0] <= now:
        _, arrival, request_id = heapq.heappop(heap)
        seq = state.seqs.get(request_id)
        if seq is not None and seq.arrival == arrival and seq.status not in (Status.SWAPPING, Status.SWAPPED):
            mark_finish(state, seq, "timeout", len(seq.outputs) - 1)


def reclaim_nothing(state: CoreState, candidates: list[Seq]) -> None:
    """``tick_end.reclaim_for_swap_in`` that reclaims nothing: ``swap_in`` then takes a candidate only if it fits
    in the blocks already free."""


def commit_streaming_overruns(state: CoreState, ctx: TickContext, step: InflightStep, msg: StepDone) -> None:
    """``settle._commit_in_bulk`` that streams every row's token, those of finished sequences (over-runs) too."""
    running = Status.RUNNING
    for seq, token in zip(step.samplers, msg.token_ids, strict=True):
        seq.inflight -= 1
        if seq.status is running:
            seq.outputs.append(token)
    ctx.emit_request_ids += msg.request_ids
    ctx.emit_token_ids += msg.token_ids
    ctx.emit_token_indices += step.sampler_indices
    ctx.emit_reasoning += [False] * len(step.samplers)
    stop_tokens = state.stop_tokens
    candidates = sorted({*step.ending, *(i for i, t in enumerate(msg.token_ids) if t in stop_tokens)})
    for i in candidates:
        seq = step.samplers[i]
        if seq.status is running:
            settle_module._apply_stop_rules(state, seq, msg.token_ids[i], step.sampler_indices[i])


def stop_matched_unless_finishing(state: CoreState, msg: StopMatched) -> None:
    """``apply.stop_matched`` that ignores a request another reason finished earlier in this tick."""
    seq = state.seqs.get(msg.request_id)
    if seq is None or seq.status is Status.FINISHED:
        return
    if mark_finish(state, seq, "stop", msg.token_index):
        del seq.outputs[msg.token_index + 1 :]


# -- the actor level ---------------------------------------------------------------------------------------------
@functools.cache
def broken_actors() -> dict[str, type]:
    """The actor level's broken classes by the name ``tickloom.runtime`` builds them under, made on first use (they
    subclass trio actors)."""
    import trio

    from tickloom.actors.deadlines import DeadlineActor
    from tickloom.actors.mailbox import ChannelOverflow
    from tickloom.actors.spill import SpillActor
    from tickloom.actors.step import StepActor

    class WakeBlindDeadlineActor(DeadlineActor):
        """``actors/deadlines.py`` as of commit 48fbc6e (the bug: a wake-up trusts the heap it slept on)."""

        def submit_nowait(self, command: Command) -> None:
            if isinstance(command, WatchDeadline):
                if len(self._live) >= self._limit:
                    raise ChannelOverflow(f"deadline actor is watching {self._limit} requests, its bound")
                self._live[command.request_id] = command.deadline_ns
                heapq.heappush(self._heap, (command.deadline_ns, command.request_id))
                self._changed.set()
            elif isinstance(command, UnwatchDeadline):
                self._live.pop(command.request_id, None)

        async def run(self) -> None:
            while True:
                while self._heap and self._live.get(self._heap[0][1]) != self._heap[0][0]:
                    heapq.heappop(self._heap)  # unwatched or re-watched
                wake_at = self._heap[0][0] / 1e9 if self._heap else math.inf
                with trio.move_on_at(wake_at):
                    await self._changed.wait()
                    self._changed = trio.Event()
                    continue
                deadline_ns, request_id = heapq.heappop(self._heap)
                del self._live[request_id]
                await self._outbox.send(DeadlineReached(request_id, deadline_ns))

    class EagerDropSpillActor(SpillActor):
        """Forgets that a copy may still be in flight: ``DropSpill`` deletes whatever is stored now, nothing later."""

        async def run(self) -> None:
            async for kind, request_id, kv, error in self._receive:
                if kind == "drop":
                    await trio.to_thread.run_sync(self.store.drop, request_id)
                elif kind == "copy":
                    if kv is None:
                        await self._outbox.send(SpillDone(request_id, False, error))
                    else:
                        await self._store(request_id, kv)

    class RetireFirstStepActor(StepActor):
        """Delivers a tick's tokens and finishes to the retire actor first, and only then writes the tick's frame."""

        def dispatch(self, commands: list[Command]) -> None:
            visible: list[Command] = [c for c in commands if isinstance(c, EmitTokens | Finish)]
            if visible:
                self._retire.deliver_nowait(visible)
            super().dispatch([c for c in commands if not isinstance(c, EmitTokens | Finish)])
            if visible:
                self._flush_for_clients()

    return {"DeadlineActor": WakeBlindDeadlineActor, "SpillActor": EagerDropSpillActor,
            "StepActor": RetireFirstStepActor}


def _broken_actor(name: str) -> AbstractContextManager[None]:
    """``tickloom.runtime`` builds its ``name`` actor from the broken class inside the block."""
    import tickloom.runtime as runtime_module

    return patched(runtime_module, name, broken_actors()[name])


# -- both levels -------------------------------------------------------------------------------------------------
@contextmanager
def patched(module: ModuleType, name: str, replacement: object) -> Iterator[None]:
    """``module.name`` is ``replacement`` inside the block, and what it was after."""
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


Variant = Callable[[], AbstractContextManager[None]]

VARIANTS: dict[str, dict[str, Variant]] = {
    "core": {
        "fence": lambda: patched(tick_end_module, "release_blocks", release_blocks_unfenced),
        "preempt-unsettled": lambda: patched(planner_module, "ensure_blocks", ensure_blocks_any_victim),
        "swapped-deadline": lambda: patched(scheduler_module, "sweep_deadlines", sweep_deadlines_skipping_swapped),
        "swap-in-no-reclaim": lambda: patched(tick_end_module, "reclaim_for_swap_in", reclaim_nothing),
        "stream-overrun": lambda: patched(settle_module, "_commit_in_bulk", commit_streaming_overruns),
        "stop-loses": lambda: patched(apply_module, "stop_matched", stop_matched_unless_finishing),
    },
    "actors": {
        "deadline-keyerror": lambda: _broken_actor("DeadlineActor"),
        "drop-overtakes-copy": lambda: _broken_actor("SpillActor"),
        "retire-before-log": lambda: _broken_actor("StepActor"),
    },
}
"""Level -> variant name -> a context manager under which the code runs with that broken function or actor."""


def check_variant(level: str, name: str | None) -> None:
    """Raises ``ValueError`` unless ``name`` is None or one of ``level``'s variants."""
    if name is not None and name not in VARIANTS[level]:
        raise ValueError(f"unknown variant {name!r} at the {level} level; known: {', '.join(sorted(VARIANTS[level]))}")


@contextmanager
def enabled(name: str | None) -> Iterator[None]:
    """Run the block with the variant ``name``, of either level (None: the real code)."""
    if name is None:
        yield
        return
    for variants in VARIANTS.values():
        if name in variants:
            with variants[name]():
                yield
            return
    raise ValueError(f"unknown variant {name!r}")
