"""The end of a tick, in the reference scheduler's order: take the finished sequences, retire them, swap in, resume.

Swap-in and resume run on every tick, including ticks with nothing active, so a parked sequence never waits
for an unrelated arrival (C11).
"""

from __future__ import annotations

from tickloom.engine.core.blocks import blocks_for
from tickloom.engine.core.context import TickContext
from tickloom.engine.core.fences import release_blocks
from tickloom.engine.core.finish import untrack_stops
from tickloom.engine.core.preemption import resume_blocks, resume_want
from tickloom.engine.core.prefix_cache import cache_full_blocks, full_block_hashes, may_hit_cache
from tickloom.engine.core.state import CoreState, Seq, ends_in_thinking
from tickloom.engine.core.status import Status, StatusEvent, change_status
from tickloom.events import DropSpill, Finish, ReleaseRequest, SwapIn, UnwatchDeadline, Usage


def take_finished(state: CoreState) -> list[Seq]:
    """This tick's finished sequences, taken out of ``state.finishing`` (left empty) for ``retire_finished``."""
    finished = state.finishing
    state.finishing = []
    return finished


def retire_finished(state: CoreState, ctx: TickContext, finished: list[Seq]) -> None:
    """Emit each finish, insert its KV into the prefix cache (unless it errored), then free or fence its blocks."""
    for seq in finished:
        reason = seq.finish_reason
        assert reason is not None
        usage = Usage(len(seq.prompt), seq.cached_prompt_tokens, len(seq.outputs), _reasoning_tokens(state, seq))
        ctx.commands.append(Finish(seq.request_id, reason, usage, seq.finish_error))
        if seq.deadline_ns is not None:
            ctx.commands.append(UnwatchDeadline(seq.request_id))
        if seq.has_spill:
            ctx.commands.append(DropSpill(seq.request_id))
            seq.has_spill = False
        if seq.bound:
            ctx.releases.append(ReleaseRequest(seq.request_id))
        if reason != "error" and seq.block_ids:
            cache_full_blocks(state, seq, min(seq.kv_settled, seq.num_tokens))
        release_blocks(state, ctx, seq)
        del state.seqs[seq.request_id]
        untrack_stops(state, seq)


def _reasoning_tokens(state: CoreState, seq: Seq) -> int:
    start, end = state.config.think_start_token, state.config.think_end_token
    if start is None:
        return 0
    thinking = ends_in_thinking(seq.prompt, start, end)
    count = 0
    for token in seq.outputs:
        if token == start:
            thinking = True
        count += thinking
        if token == end:
            thinking = False
    return count


def swap_in(state: CoreState, ctx: TickContext) -> None:
    """Bring swapped sequences back, the reference scheduler's loop.

    Candidates are swapped sequences whose KV is in the host tier. While there are candidates and the batch
    has room: if the smallest does not fit in the free blocks, reclaim prefix-cache blocks pass by pass until
    it fits or a pass frees nothing; then resume the first candidate, in swap-out order, that fits.
    """
    if not state.swapping_or_swapped:
        return
    pool = state.pool
    size = state.config.block_size
    active = state.active
    while active < state.config.max_batch_size:
        candidates = [seq for seq in state.swapping_or_swapped if seq.status is Status.SWAPPED and seq.swap_ready]
        if not candidates:
            return
        reclaim_for_swap_in(state, candidates)
        chosen = next((s for s in candidates if blocks_for(s.spill_tokens, size) <= pool.num_free), None)
        if chosen is None:
            return
        swap_back_in(state, ctx, chosen)
        active += 1


def reclaim_for_swap_in(state: CoreState, candidates: list[Seq]) -> None:
    """Reclaim prefix-cache blocks, pass by pass, until the smallest candidate fits or a pass frees nothing."""
    pool = state.pool
    smallest = min(blocks_for(seq.spill_tokens, state.config.block_size) for seq in candidates)
    while pool.num_free < smallest and pool.reclaim(smallest - pool.num_free):
        pass


def swap_back_in(state: CoreState, ctx: TickContext, seq: Seq) -> None:
    """Give a swapped sequence fresh blocks for its spilled KV (they must be free), copy it in, and run it again."""
    state.swapping_or_swapped.remove(seq)
    seq.block_ids = state.pool.allocate(blocks_for(seq.spill_tokens, state.config.block_size))
    seq.sent_blocks = len(seq.block_ids)
    seq.num_computed = seq.kv_settled = seq.spill_tokens
    seq.reserve = len(seq.block_ids)
    seq.first_planned = True
    _resume(state, seq, StatusEvent.SWAP_IN)
    ctx.commands.append(SwapIn(seq.request_id, list(seq.block_ids), seq.spill_tokens))
    ctx.unblocked = True


def _resume(state: CoreState, seq: Seq, event: StatusEvent) -> None:
    change_status(seq, event, Status.RUNNING)
    seq.swap_ready = False
    seq.immune_until = len(seq.outputs) + state.config.preempt_immunity_tokens
    state.join_running(seq)


def resume_preempted(state: CoreState, ctx: TickContext) -> None:
    """Resume requeued sequences, fewest blocks first, each when ``need + 1`` blocks (``resume_want``) can be had.

    The sequence's own cached prefix counts towards its need and is never reclaimed to make room for it. Every
    sequence fits eventually: ``resume_want`` is at most ``blocks_for(max_seq_len)``, which the configuration
    keeps within the pool.
    """
    if not state.preempted:
        return
    pool = state.pool
    size = state.config.block_size
    active = state.active
    while state.preempted and active < state.config.max_batch_size:
        seq = min(state.preempted, key=lambda s: (resume_blocks(state, s), s.arrival))
        need = resume_blocks(state, seq)
        want = resume_want(state, seq)
        # A fresh prompt keeps its last token to compute (it samples); a history's pending token is fed later.
        reusable = seq.prefill_target if seq.outputs else seq.prefill_target - 1
        cached = state.config.prefix_caching and may_hit_cache(seq)
        hits = pool.lookup(full_block_hashes(state, seq, reusable)) if cached else []
        new_blocks = want - len(hits)
        if new_blocks > pool.capacity(hits):
            return
        if pool.num_free < new_blocks:
            pool.reclaim(new_blocks - pool.num_free, protect=hits)
        pool.claim(hits)
        seq.block_ids = list(hits) + pool.allocate(need - len(hits))
        seq.num_computed = seq.kv_settled = len(hits) * size
        seq.first_planned = True
        seq.reserve = want
        if seq not in state.reserving:  # it may still be listed from before it was preempted
            state.reserving.append(seq)
        state.preempted.remove(seq)
        _resume(state, seq, StatusEvent.RESUME)
        ctx.unblocked = True
        active += 1
