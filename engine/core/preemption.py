"""Preemption: choosing a victim on KV exhaustion, taking it off the device, and the blocks it comes back to.

A victim is swapped out when a spill store exists (its KV is copied out, ``SWAPPING`` then ``SWAPPED``) and
requeued otherwise (its KV is dropped and recomputed, ``PREEMPTED``); ``tick_end`` brings it back through swap-in
or resume.
"""

from __future__ import annotations

from tickloom.engine.core.blocks import blocks_for, blocks_holding
from tickloom.engine.core.context import TickContext
from tickloom.engine.core.fences import is_settled, release_blocks
from tickloom.engine.core.prefix_cache import cache_full_blocks
from tickloom.engine.core.state import CoreState, Seq
from tickloom.engine.core.status import Status, StatusEvent, change_status
from tickloom.events import Preempted, SpillOut


def choose_victim(state: CoreState, step_id: int) -> Seq | None:
    """The running sequence to preempt on KV exhaustion, or None if none may be.

    Candidates are settled (no unsettled step references them) and not yet given a row in the step being
    planned. Non-immune ones go first; among them the least important (highest priority value), then the one
    with the fewest generated tokens, then the latest admitted. If all are immune the same order applies.
    """
    best: Seq | None = None
    best_key: tuple[int, int, int, int] | None = None
    settled = state.settled_step
    for seq in state.running:
        if seq.status is not Status.RUNNING or seq.last_step > settled or seq.last_step == step_id:
            continue
        key = (0 if len(seq.outputs) < seq.immune_until else 1, seq.priority, -len(seq.outputs), seq.admitted)
        if best_key is None or key > best_key:
            best, best_key = seq, key
    return best


def preempt(state: CoreState, ctx: TickContext, victim: Seq) -> None:
    """Take a settled running sequence off the device (``take_off_device``). A victim is always settled: no
    unsettled step references its blocks, and it has no row in flight."""
    assert victim.inflight == 0 and is_settled(state, victim), "victims are settled"
    take_off_device(state, ctx, victim)


def take_off_device(state: CoreState, ctx: TickContext, victim: Seq) -> None:
    """Swap a running sequence out if a spill store exists, else requeue it (``preempt`` checks it is settled).

    Swapping keeps its KV: ``SpillOut`` copies the blocks out before any later command can reuse them, since
    the executor runs commands in order; outputs still without KV (``catch_up``) stay so, and are written after the
    swap-in. Requeueing drops the KV (after offering its full blocks to the prefix
    cache) and re-prefills the history on resume. A sequence still prefilling is always requeued: there is
    little KV to save.
    """
    state.lane = None
    ctx.lane_broken = True
    # A new list, not ``remove``: ``plan_step`` may be iterating the old one (it skips the victim by status).
    state.running = [seq for seq in state.running if seq is not victim]
    decoding = victim.num_computed + victim.catch_up >= victim.prefill_target and victim.outputs
    if state.config.spill_enabled and decoding:
        ctx.commands.append(Preempted(victim.request_id, "swap"))
        # Only the blocks that hold verified KV: a table may run past them (blocks taken for proposal slots whose
        # proposals were rejected), and the swap-in gives back ``blocks_for(kv_settled)``, no more.
        held = blocks_holding(victim.kv_settled, state.config.block_size)
        ctx.commands.append(SpillOut(victim.request_id, victim.block_ids[:held], victim.kv_settled))
        victim.spill_tokens = victim.kv_settled
        victim.swap_ready = False
        victim.has_spill = True  # until its first step after swap-in settles, or it ends: then ``DropSpill``
        change_status(victim, StatusEvent.SWAP_OUT, Status.SWAPPING)
        state.swapping_or_swapped.append(victim)
    else:
        ctx.commands.append(Preempted(victim.request_id, "requeue"))
        cache_full_blocks(state, victim, victim.kv_settled)
        change_status(victim, StatusEvent.REQUEUE, Status.PREEMPTED)
        state.preempted.append(victim)
        victim.catch_up = 0  # the whole history is prefilled again on resume
    release_blocks(state, ctx, victim)
    victim.num_computed = 0
    victim.kv_settled = 0
    victim.first_planned = False
    victim.reserve = 0


def resume_blocks(state: CoreState, seq: Seq) -> int:
    """Blocks a parked sequence needs to come back: its history plus room for the next token."""
    return blocks_for(seq.prefill_target, state.config.block_size)


def resume_want(state: CoreState, seq: Seq) -> int:
    """Blocks a parked sequence comes back to: its need plus one block of growth, but never more than a sequence of
    ``max_seq_len`` tokens can use. Without the cap, a sequence parked one block from ``max_seq_len`` in the
    smallest legal pool would ask for a block beyond the pool and be ended, though it fits."""
    config = state.config
    return min(resume_blocks(state, seq) + 1, blocks_for(config.max_seq_len, config.block_size))
