"""Phase 2 of a tick: admit waiting requests through the KV gate, first come first served.

The gate serves the waiting queue strictly in (priority, arrival) order: if the head does not fit, nothing
behind it is admitted (no overtaking). A request needs ``blocks(prompt + min(max_tokens, watermark))`` blocks,
less the prefix-cache blocks it would hit, the tokens clamped to ``max_seq_len``: no sequence ever holds more,
and the config guarantees the pool holds one such sequence, so a reservation never exceeds what an idle pool
has. What is already promised counts against the free blocks: the unallocated part of every admitted sequence's
reservation, and the resume needs of preempted ones. Swapped sequences are not counted; they return only through
swap-in.

A lone request (nothing running) reserves its prompt only: the watermark keeps room for the outputs of a batch,
and there is no batch to keep it from. So the head is never held back by its watermark while the pool idles.
"""

from __future__ import annotations

from tickloom.engine.core.blocks import blocks_for
from tickloom.engine.core.context import TickContext
from tickloom.engine.core.fences import is_settled
from tickloom.engine.core.preemption import preempt, resume_want
from tickloom.engine.core.prefix_cache import full_block_hashes, may_hit_cache
from tickloom.engine.core.state import CoreState, Seq
from tickloom.engine.core.status import Status, StatusEvent, change_status
from tickloom.events import BindRequest


def in_flight_demand(state: CoreState) -> int:
    """Blocks promised but not yet allocated: admitted reservations plus parked sequences' resume needs."""
    running = Status.RUNNING
    state.reserving = [s for s in state.reserving if s.status is running and s.reserve > len(s.block_ids)]
    demand = sum([seq.reserve - len(seq.block_ids) for seq in state.reserving])
    for seq in state.preempted:
        demand += resume_want(state, seq)
    return demand


def prefix_hits(state: CoreState, seq: Seq) -> list[int]:
    """Cached blocks the prompt would reuse. At most ``prompt_len - 1`` tokens: the last is always computed."""
    if not state.config.prefix_caching or not may_hit_cache(seq):
        return []
    # Every full block of the prompt is hashed in one go, the last one too (which its first chunk will
    # register), though only the ones before the last token may hit.
    usable = (len(seq.prompt) - 1) // state.config.block_size
    return state.pool.lookup(full_block_hashes(state, seq, len(seq.prompt))[:usable])


def admission_need(state: CoreState, seq: Seq, lone: bool = False) -> int:
    """Blocks the gate reserves for ``seq``: its prompt plus the watermark's room, or its prompt alone if ``lone``.

    The tokens are clamped to ``max_seq_len``, which the sequence never exceeds.
    """
    config = state.config
    tokens = len(seq.prompt) if lone else len(seq.prompt) + min(seq.params.max_tokens, config.admit_watermark)
    return blocks_for(min(tokens, config.max_seq_len), config.block_size)


def admit(state: CoreState, ctx: TickContext) -> None:
    """Admit from the head of the waiting queue while it fits and the batch has room."""
    if not state.waiting:
        return
    config = state.config
    active = state.active
    if active >= config.max_batch_size:
        return
    demand = in_flight_demand(state)
    waiting = state.waiting
    while active < config.max_batch_size:
        head = waiting.head()
        if head is None:
            return
        need = admission_need(state, head)
        hits = prefix_hits(state, head)
        if not make_room(state, ctx, need - len(hits), demand, hits):
            lone = admission_need(state, head, lone=True)
            if active or lone == need or not make_room(state, ctx, lone - len(hits), demand, hits):
                return
            need = lone
        waiting.pop_head()
        change_status(head, StatusEvent.ADMIT, Status.RUNNING)
        head.admitted = state.next_admission
        state.next_admission += 1
        head.reserve = need
        state.reserving.append(head)  # a waiting request was never running: it is not in the list yet
        state.join_running(head)
        active += 1
        demand += need
        masked = [] if head.params.ignore_eos else list(config.eos_token_ids)
        masked += [t for t in head.params.stop_token_ids if t not in masked]
        ctx.commands.append(
            BindRequest(head.request_id, head.params, head.seed, len(head.prompt), masked, list(head.prompt))
        )
        head.bound = True


def make_room(state: CoreState, ctx: TickContext, blocks: int, demand: int, hits: list[int]) -> bool:
    """Get ``blocks`` free beyond ``demand``: reclaim cached blocks, then (with a spill store) swap out.

    Swapping picks the settled, non-immune decoding sequence holding the most blocks, then checks again; its
    freed blocks may land in the prefix cache, so each swap is followed by another reclaim. Nothing is swapped
    unless swapping every candidate would cover the shortfall: a swap that cannot make the head fit only costs
    I/O.
    """
    pool = state.pool

    def shortfall_after_reclaim() -> int:
        short = blocks - (pool.num_free - demand)
        if short > 0:
            pool.reclaim(short, protect=hits)
            short = blocks - (pool.num_free - demand)
        return short

    short = shortfall_after_reclaim()
    if short <= 0:
        return True
    if not state.config.spill_enabled:
        return False
    candidates = [
        seq
        for seq in state.running
        if seq.status is Status.RUNNING
        and is_settled(state, seq)
        and seq.outputs
        and seq.num_computed + seq.catch_up >= seq.prefill_target
        and len(seq.outputs) >= seq.immune_until
    ]
    if sum(len(seq.block_ids) for seq in candidates) + pool.capacity(hits) - pool.num_free < short:
        return False
    candidates.sort(key=lambda seq: (len(seq.block_ids), seq.admitted), reverse=True)
    for victim in candidates:
        preempt(state, ctx, victim)
        if shortfall_after_reclaim() <= 0:
            return True
    return False
