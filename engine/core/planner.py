"""Phase 3 of a tick: plan the next step (decode rows, then prefill chunks) and handle KV exhaustion.

Running ahead (``pipeline_depth`` 2): a decoding sequence whose token from the step in flight is not known yet
still gets a row, fed from that step (``RunStep.fed_from``), on the assumption that the step yields exactly one
token for it. The executor substitutes the sampled id. Such a row is planned only if the sequence could still
need it: not when the in-flight token may be its last (``remaining <= 1``, the context ceiling), and not when
the next token will be forced (the thinking budget). If that token ends the request anyway (EOS, a stop), the
row is an over-run: ``settle_step`` discards it, and the blocks it references stay fenced until it settles.

KV exhaustion: reclaim prefix-cache blocks first, then preempt a victim (``lifecycle.choose_victim``). Rows of
unsettled steps are never victims; if only they could give blocks, the row waits for the next step instead.
"""

from __future__ import annotations

from engine.core.context import TickContext
from engine.core.lifecycle import cache_full_blocks, choose_victim, full_block_hashes, preempt
from engine.core.state import CoreState, InflightStep, Seq, Status
from events import NO_SAMPLE, NOT_FED, RunStep


def _ensure_blocks(state: CoreState, ctx: TickContext, seq: Seq, blocks: int, step_id: int) -> bool:
    """Grow ``seq``'s table to ``blocks`` blocks, reclaiming and preempting as needed; False if it cannot now.

    If ``seq`` itself is chosen as the victim it is preempted and False is returned.
    """
    pool = state.pool
    while len(seq.block_ids) < blocks:
        short = blocks - len(seq.block_ids) - pool.num_free
        if short > 0:
            pool.reclaim(short)
        if pool.num_free >= blocks - len(seq.block_ids):
            seq.block_ids.extend(pool.allocate(blocks - len(seq.block_ids)))
            return True
        victim = choose_victim(state, step_id)
        if victim is None:
            return False
        preempt(state, ctx, victim)
        if victim is seq:
            return False
    return True


def _can_run_ahead(state: CoreState, seq: Seq) -> bool:
    """Whether a sequence with a token in flight may get a row fed from it."""
    if seq.inflight >= state.config.pipeline_depth:
        return False
    params = seq.params
    produced = len(seq.outputs) + seq.inflight
    if produced + 1 > params.max_tokens or len(seq.prompt) + produced + 1 > state.config.max_seq_len:
        return False
    budget = params.thinking_budget
    return not (seq.thinking and budget is not None and seq.thinking_tokens + seq.inflight >= budget)


def plan_step(state: CoreState, ctx: TickContext) -> RunStep | None:
    """Plan one step if the pipeline has room; returns it (emitted at the end of the tick) or None."""
    config = state.config
    if state.shut_down or len(state.steps) >= config.pipeline_depth:
        return None
    state.prune_running()
    running = state.running
    if not running:
        return None
    step_id = state.next_step_id
    block_size = config.block_size
    token_budget = config.max_batch_tokens
    is_running = Status.RUNNING
    rows: list[Seq] = []
    positions: list[int] = []
    token_ids: list[int] = []
    fed: list[tuple[int, int]] = []
    sample_indices: list[int] = []
    prefilling: list[Seq] = []
    rows_append = rows.append
    positions_append = positions.append
    token_ids_append = token_ids.append
    sample_indices_append = sample_indices.append

    # Decode rows. This loop is the hot path of a steady tick (one pass per running sequence), so it is kept
    # flat: ``prefill_target`` is inlined, the sequences still prefilling are collected for the prefill loop
    # below (which then need not scan the whole batch), and the columns that are alike for most decode rows
    # (fed-from, block deltas, counts, samplers, kv ends) are built after the loop. A row's block-table delta
    # can be read then: its table cannot change later in the plan (a victim never has a row in it).
    # It iterates ``running`` itself, not a copy: ``preempt`` (reached through ``_ensure_blocks``) rebinds
    # ``state.running`` to a new list rather than mutating this one, and a victim it takes is skipped here by
    # its status, exactly as with a copy.
    for seq in running:
        if token_budget <= 0:
            break
        if seq.status is not is_running:
            continue
        outputs = seq.outputs
        num_outputs = len(outputs)
        position = seq.num_computed
        if position < (len(seq.prompt) + num_outputs - 1 if num_outputs else len(seq.prompt)):
            prefilling.append(seq)
            continue
        inflight = seq.inflight
        if inflight and not _can_run_ahead(state, seq):
            continue
        if position // block_size >= len(seq.block_ids) and not _ensure_blocks(
            state, ctx, seq, position // block_size + 1, step_id
        ):
            continue
        if inflight:
            fed.append((len(rows), seq.last_step))
            token_ids_append(0)
        else:
            token_ids_append(outputs[-1])
        rows_append(seq)
        positions_append(position)
        sample_indices_append(num_outputs + inflight)
        seq.num_computed = position + 1
        seq.inflight = inflight + 1
        seq.last_step = step_id
        token_budget -= 1
    # The columns every decode row has alike are built in bulk: rows fed from a step in flight are patched in,
    # and the block-table deltas (usually none: a table grows once every ``block_size`` tokens) are read now,
    # as no table of a row already planned can change later in the plan.
    fed_from = [NOT_FED] * len(rows)
    for row, source in fed:
        fed_from[row] = source
    block_starts = [seq.sent_blocks for seq in rows]
    num_new = [len(seq.block_ids) - sent for seq, sent in zip(rows, block_starts, strict=True)]
    new_ids: list[int] = []
    if any(num_new):
        for seq, sent, grown in zip(rows, block_starts, num_new, strict=True):
            if grown:
                new_ids += seq.block_ids[sent:]
                seq.sent_blocks = sent + grown
    counts = [1] * len(rows)
    samplers = list(rows)
    sampled = list(sample_indices)
    kv_ends = [position + 1 for position in positions]
    registered: list[int] = []

    # Prefill chunks, in running order. When the decode loop stopped early the token budget is spent, so no
    # chunk is planned and the sequences it did not reach need no look.
    prefill_budget = min(config.max_prefill_tokens, token_budget)
    for seq in prefilling:
        if prefill_budget <= 0:
            break
        if seq.status is not is_running or seq.num_computed >= seq.prefill_target:
            continue
        fresh = not seq.first_planned
        if fresh:
            _claim_prefix(state, seq)
        start = seq.num_computed
        count = min(seq.prefill_target - start, prefill_budget)
        if not _ensure_blocks(state, ctx, seq, (start + count - 1) // block_size + 1, step_id):
            if fresh and seq.status is Status.RUNNING:
                _unclaim_prefix(state, seq)
            continue
        end = start + count
        rows.append(seq)
        positions.append(start)
        counts.append(count)
        token_ids.extend(seq.tokens(start, end))
        fed_from.append(NOT_FED)
        if end == len(seq.prompt) and not seq.outputs:
            sample_indices.append(0)
            samplers.append(seq)
            sampled.append(0)
            seq.inflight += 1
        else:
            sample_indices.append(NO_SAMPLE)
        kv_ends.append(end)
        seq.num_computed = end
        seq.last_step = step_id
        prefill_budget -= count
        _add_delta(seq, block_starts, num_new, new_ids)
        if config.prefix_caching:
            registered += cache_full_blocks(state, seq, end)

    if not rows:
        return None
    request_ids = [seq.request_id for seq in rows]
    # Equal lengths mean every row samples (decode rows always do), so the two id lists are the same.
    sampler_ids = request_ids if len(samplers) == len(rows) else [seq.request_id for seq in samplers]
    state.next_step_id += 1
    state.steps.append(InflightStep(step_id, rows, samplers, sampled, kv_ends, registered, sampler_ids))
    ctx.planned_step = True
    return RunStep(
        step_id,
        request_ids,
        positions,
        counts,
        token_ids,
        fed_from,
        sample_indices,
        block_starts,
        num_new,
        new_ids,
    )


def _add_delta(seq: Seq, block_starts: list[int], num_new: list[int], new_ids: list[int]) -> None:
    """Record a row's block-table delta: only the blocks appended since its last step travel in ``RunStep``."""
    table = seq.block_ids
    sent = seq.sent_blocks
    block_starts.append(sent)
    num_new.append(len(table) - sent)
    if len(table) > sent:
        new_ids.extend(table[sent:])
        seq.sent_blocks = len(table)


def _claim_prefix(state: CoreState, seq: Seq) -> None:
    """On a fresh sequence's first chunk: reuse the cached blocks of its prompt's longest cached prefix.

    Looked up now, not at admission, so that a request admitted in the same tick as an identical one hits the
    blocks the other's chunk registers earlier in this very plan. (The executor writes every row's KV for a
    layer before any row attends, so a hit on a block filled in the same step is safe.)
    """
    seq.first_planned = True
    if not state.config.prefix_caching or seq.block_ids:
        return
    hits = state.pool.lookup(full_block_hashes(state, seq, len(seq.prompt) - 1))
    if not hits:
        return
    state.pool.claim(hits)
    seq.block_ids = list(hits)
    seq.num_computed = seq.kv_settled = len(hits) * state.config.block_size
    if not seq.outputs:
        seq.cached_prompt_tokens = seq.num_computed


def _unclaim_prefix(state: CoreState, seq: Seq) -> None:
    """Undo ``_claim_prefix`` after a failed allocation: the hit blocks' refcounts return to what they were."""
    state.pool.release(seq.block_ids)
    seq.block_ids = []
    seq.num_computed = seq.kv_settled = seq.cached_prompt_tokens = 0
    seq.first_planned = False
