"""Transitions shared by several phases: finishing, preempting, caching and freeing a sequence's blocks."""

from __future__ import annotations

from tickloom.engine.core.blocks import ROOT_HASH, blocks_for, chain_hashes, pack_tokens
from tickloom.engine.core.config import CoreConfig
from tickloom.engine.core.context import TickContext
from tickloom.engine.core.state import CoreState, Seq
from tickloom.engine.core.status import FINISH_PRECEDENCE, QUEUE_OF, Status, StatusEvent, change_status
from tickloom.events import FinishReason, Preempted, SpillOut


def mark_finish(
    state: CoreState, seq: Seq, reason: FinishReason, index: int, error: str = "", dequeue: bool = True
) -> bool:
    """Finish ``seq`` at output ``index`` (-1: before any output); True if this reason is the one that stands.

    Several reasons may arrive in one tick. The earliest token index wins, as the client's stream ends at the
    first terminal condition; at the same index, precedence decides (timeout > cancelled > stop > length >
    error). The sequence stops being scheduled at once and is retired at the end of the tick. With ``dequeue``
    False a parked sequence is left in its queue, for a caller that empties every queue itself (shutdown).
    """
    if seq.finish_reason is not None:
        current = (seq.finish_index, -FINISH_PRECEDENCE[seq.finish_reason])
        if (index, -FINISH_PRECEDENCE[reason]) >= current:
            return False
    else:
        status = seq.status
        change_status(seq, StatusEvent.FINISH, Status.FINISHED)
        if status is Status.RUNNING:
            state.stale.append(seq)  # it stays in ``running`` until the next prune
        elif not dequeue:
            pass
        elif status is Status.WAITING:
            state.waiting.discard(seq)  # a tombstone: O(1), so a mass cancel is linear
        else:
            getattr(state, QUEUE_OF[status]).remove(seq)
        state.finishing.append(seq)
    seq.finish_reason = reason
    seq.finish_index = index
    seq.finish_error = error
    return True


def stop_rule(config: CoreConfig, seq: Seq) -> tuple[frozenset[int], int]:
    """(tokens that may stop ``seq``, the output count that ends it by length): fixed for its whole life."""
    rule = seq._stop_rule
    if rule is None:
        params = seq.params
        stops = frozenset(params.stop_token_ids) if params.ignore_eos else frozenset(
            (*config.eos_token_ids, *params.stop_token_ids))
        rule = seq._stop_rule = (stops, min(params.max_tokens, config.max_seq_len - len(seq.prompt)))
    return rule


def track_stops(state: CoreState, seq: Seq) -> None:
    """Count a new live request's stop tokens into ``state.stop_tokens``."""
    refs = state.stop_refs
    for token in stop_rule(state.config, seq)[0]:
        count = refs.get(token, 0)
        if not count:
            state.stop_tokens.add(token)
        refs[token] = count + 1


def untrack_stops(state: CoreState, seq: Seq) -> None:
    """Uncount a retired request's stop tokens: a token no live request stops on leaves ``state.stop_tokens``."""
    refs = state.stop_refs
    for token in stop_rule(state.config, seq)[0]:
        count = refs[token] - 1
        if count:
            refs[token] = count
        else:
            del refs[token]
            state.stop_tokens.discard(token)


def may_hit_cache(seq: Seq) -> bool:
    """Whether the prefix cache may skip computing ``seq``'s cached prefix. Not for a request that asks for prompt
    logprobs before its first token: every prompt position must be computed to report them (vLLM does the same).
    Its blocks still enter the cache for others, and once it has output 0 (say after a requeue) it may hit."""
    return seq.params.prompt_logprobs is None or bool(seq.outputs)


def is_settled(state: CoreState, seq: Seq) -> bool:
    """No unsettled step references the sequence's blocks."""
    return seq.last_step <= state.settled_step


def full_block_hashes(state: CoreState, seq: Seq, num_tokens: int) -> list[bytes]:
    """Hashes of the full blocks among the first ``num_tokens`` tokens, extending ``seq.hashes`` as needed."""
    size = state.config.block_size
    hashes = seq.hashes
    have, want = len(hashes), num_tokens // size
    if want > have:
        packed = pack_tokens(seq.tokens(have * size, want * size))
        hashes += chain_hashes(hashes[-1] if hashes else ROOT_HASH, packed, size, seq.salt)
    return hashes[:want]


def cache_full_blocks(state: CoreState, seq: Seq, num_tokens: int) -> list[int]:
    """Offer the full blocks of the first ``num_tokens`` tokens to the prefix cache; returns those registered."""
    if not state.config.prefix_caching:
        return []
    registered = []
    blocks = seq.block_ids
    pool = state.pool
    by_hash = pool.by_hash
    hash_of = pool.hash_of
    hashes = full_block_hashes(state, seq, min(num_tokens, len(blocks) * state.config.block_size))
    for block, h in zip(blocks, hashes, strict=False):  # there are no more hashes than blocks
        # ``BlockPool.register``, inlined: every prefill chunk and every retirement offers all the full blocks.
        if h not in by_hash and hash_of[block] is None:
            hash_of[block] = h
            by_hash[h] = block
            registered.append(block)
    return registered


def release_blocks(state: CoreState, ctx: TickContext, seq: Seq) -> None:
    """Free a sequence's blocks now, or fence them until the newest step that references them settles."""
    if seq.block_ids:
        if is_settled(state, seq):
            state.pool.release(seq.block_ids)
            ctx.unblocked = True
        else:
            state.fences.append((seq.last_step, seq.request_id, seq.block_ids))
    seq.block_ids = []
    seq.sent_blocks = 0


def release_fences(state: CoreState, ctx: TickContext) -> None:
    """Release fenced blocks whose last referencing step has settled."""
    settled = state.settled_step
    if not any(fence[0] <= settled for fence in state.fences):
        return
    kept = [fence for fence in state.fences if fence[0] > settled]
    for step, _, blocks in state.fences:
        if step <= settled:
            state.pool.release(blocks)
    state.fences.clear()
    state.fences.extend(kept)
    ctx.unblocked = True


def resume_blocks(state: CoreState, seq: Seq) -> int:
    """Blocks a parked sequence needs to come back: its history plus room for the next token."""
    return blocks_for(seq.prefill_target, state.config.block_size)


def resume_want(state: CoreState, seq: Seq) -> int:
    """Blocks a parked sequence comes back to: its need plus one block of growth, but never more than a sequence of
    ``max_seq_len`` tokens can use. Without the cap, a sequence parked one block from ``max_seq_len`` in the
    smallest legal pool would ask for a block beyond the pool and be ended, though it fits."""
    config = state.config
    return min(resume_blocks(state, seq) + 1, blocks_for(config.max_seq_len, config.block_size))


def preempt(state: CoreState, ctx: TickContext, victim: Seq) -> None:
    """Take a settled running sequence off the device (``take_off_device``). A victim is always settled: no
    unsettled step references its blocks, and it has no row in flight."""
    assert victim.inflight == 0 and is_settled(state, victim), "victims are settled"
    take_off_device(state, ctx, victim)


def take_off_device(state: CoreState, ctx: TickContext, victim: Seq) -> None:
    """Swap a running sequence out if a spill store exists, else requeue it (``preempt`` checks it is settled).

    Swapping keeps its KV: ``SpillOut`` copies the blocks out before any later command can reuse them, since
    the executor runs commands in order. Requeueing drops the KV (after offering its full blocks to the prefix
    cache) and re-prefills the history on resume. A sequence still prefilling is always requeued: there is
    little KV to save.
    """
    state.lane = None
    ctx.lane_broken = True
    # A new list, not ``remove``: ``plan_step`` may be iterating the old one (it skips the victim by status).
    state.running = [seq for seq in state.running if seq is not victim]
    decoding = victim.num_computed >= victim.prefill_target and victim.outputs
    if state.config.spill_enabled and decoding:
        ctx.commands.append(Preempted(victim.request_id, "swap"))
        ctx.commands.append(SpillOut(victim.request_id, list(victim.block_ids), victim.kv_settled))
        victim.spill_tokens = victim.kv_settled
        victim.swap_ready = False
        victim.has_spill = True  # until its first step after swap-in settles, or it ends: then ``DropSpill``
        change_status(victim, StatusEvent.SWAP_OUT, Status.SWAPPING)
        state.swapped.append(victim)
    else:
        ctx.commands.append(Preempted(victim.request_id, "requeue"))
        cache_full_blocks(state, victim, victim.kv_settled)
        change_status(victim, StatusEvent.REQUEUE, Status.PREEMPTED)
        state.preempted.append(victim)
    release_blocks(state, ctx, victim)
    victim.num_computed = 0
    victim.kv_settled = 0
    victim.first_planned = False
    victim.reserve = 0


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
