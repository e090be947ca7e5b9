"""Phase 3 of a tick: plan the next step (decode rows, then prefill chunks) and handle KV exhaustion.

Running ahead (``pipeline_depth`` 2): a decoding sequence whose token from the step in flight is not known yet
still gets a row, fed from that step (``RunStep.fed_from``), on the assumption that the step yields exactly one
token for it. The executor substitutes the sampled id. Such a row is planned only if the sequence could still
need it: not when the in-flight token may be its last (``remaining <= 1``, the context ceiling), and not when
the next token will be forced (the thinking budget). If that token ends the request anyway (EOS, a stop), the
row is an over-run: ``settle_step`` discards it, and the blocks it references stay fenced until it settles.

Extra tokens (``StepDone.extra_token_ids``, accepted after a row's sampled token without a forward pass): the row
fed from that step was planned to sample the output the first extra token now is, so it is void (``Seq.void``):
it still writes its input's KV, and settles without a token. The extra tokens' KV is written by the sequence's
next row, a catch-up row (``Seq.catch_up``) planned with the prefill chunks: it runs from the first position
without KV through the pending token, and samples the next output as a decode row would.

Proposal slots (speculative decoding, ``engine.core.speculation``): a decode row may end in slots the executor's
proposer fills. No row is fed from such a row, since how many tokens it yields is unknown until it settles.

KV exhaustion: reclaim prefix-cache blocks first, then preempt a victim (``preemption.choose_victim``). Rows of
unsettled steps are never victims; if only they could give blocks, the row waits for the next step instead.

This module is the general plan, and the specification: ``engine.core.decode_lane`` derives most steady-state steps
from the previous one in bulk, and must plan exactly what this would.
"""

from __future__ import annotations

from tickloom.engine.core.columns import StepColumns
from tickloom.engine.core.context import TickContext
from tickloom.engine.core.decode_lane import advance_lane, plan_lane_decode, start_lane
from tickloom.engine.core.finish import stop_rule
from tickloom.engine.core.preemption import choose_victim, preempt
from tickloom.engine.core.prefix_cache import cache_full_blocks, full_block_hashes, may_hit_cache
from tickloom.engine.core.speculation import plan_slots
from tickloom.engine.core.state import CoreState, InflightStep, Seq
from tickloom.engine.core.status import Status
from tickloom.events import NO_SAMPLE, NOT_FED, PROPOSE, RunStep


def ensure_blocks(state: CoreState, ctx: TickContext, seq: Seq, blocks: int, step_id: int) -> bool:
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


def can_run_ahead(state: CoreState, seq: Seq) -> bool:
    """Whether a sequence with a token in flight may get a row fed from it."""
    if seq.inflight >= state.config.pipeline_depth or seq.spec_row:
        return False
    params = seq.params
    produced = len(seq.outputs) + seq.inflight - seq.void
    if produced + 1 > params.max_tokens or len(seq.prompt) + produced + 1 > state.config.max_seq_len:
        return False
    budget = params.thinking_budget
    return not (seq.thinking and budget is not None and seq.thinking_tokens + seq.inflight >= budget)


def plan_step(state: CoreState, ctx: TickContext) -> RunStep | None:
    """Plan one step if the pipeline has room; returns it (emitted at the end of the tick) or None."""
    config = state.config
    if state.shut_down or len(state.steps) >= config.pipeline_depth:
        return None
    lane = state.lane
    state.lane = None
    if lane is not None:
        planned = plan_lane_decode(state, lane)
        if planned is not None:
            budget = config.max_batch_tokens - len(planned.seqs)
            remaining, completed = plan_prefill(state, ctx, planned, lane.prefilling, budget)
            if not planned.seqs:
                return None
            if not ctx.lane_broken:
                advance_lane(state, lane, remaining, completed)
            return emit_step(state, ctx, planned)
    state.prune_running()
    if not state.running:
        return None
    planned, prefilling, left_out = _plan_decode(state, ctx)
    if planned is None:
        return None
    decode_rows = len(planned.seqs)
    remaining, completed = plan_prefill(state, ctx, planned, prefilling, config.max_batch_tokens - decode_rows)
    if not planned.seqs:
        return None
    if (prefilling is not None and not ctx.lane_broken and config.think_start_token is None and not state.void_rows
            and not config.speculative_tokens):
        start_lane(state, planned, decode_rows, remaining, completed, left_out)
    return emit_step(state, ctx, planned)


def _plan_decode(state: CoreState, ctx: TickContext) -> tuple[StepColumns | None, list[Seq] | None, list[Seq]]:
    """The decode rows of the next step, in running order, with the sequences still prefilling.

    Returns (columns, prefilling, left out). ``prefilling`` is None when the token budget ran out before every
    running sequence was looked at (the lane needs the whole list); ``left out`` are decode sequences that got
    no row.
    """
    config = state.config
    running = state.running
    step_id = state.next_step_id
    block_size = config.block_size
    token_budget = config.max_batch_tokens
    is_running = Status.RUNNING
    seqs: list[Seq] = []
    positions: list[int] = []
    token_ids: list[int] = []
    fed: list[tuple[int, int]] = []
    sample_indices: list[int] = []
    prefilling: list[Seq] = []
    spec: list[tuple[int, int]] = []  # (row, proposal slots)
    speculating = config.speculative_tokens > 0
    looked_at_all = True
    left_out: list[Seq] = []
    seqs_append = seqs.append
    positions_append = positions.append
    token_ids_append = token_ids.append
    sample_indices_append = sample_indices.append

    # One pass per running sequence, kept flat: ``prefill_target`` is inlined, the sequences still prefilling
    # are collected for the prefill loop (which then need not scan the whole batch), and the columns that are
    # alike for most decode rows (fed-from, block deltas, counts, samplers, kv ends) are built after the loop.
    # A row's block-table delta can be read then: its table cannot change later in the plan (a victim never
    # has a row in it). It iterates ``running`` itself, not a copy: ``preempt`` (reached through
    # ``ensure_blocks``) rebinds ``state.running`` to a new list rather than mutating this one, and a victim it
    # takes is skipped here by its status, exactly as with a copy.
    for seq in running:
        if token_budget <= 0:
            looked_at_all = False
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
        live = inflight - seq.void  # rows in flight that will bring a new output
        if live and not can_run_ahead(state, seq):
            left_out.append(seq)
            continue
        if position // block_size >= len(seq.block_ids) and not ensure_blocks(
            state, ctx, seq, position // block_size + 1, step_id
        ):
            left_out.append(seq)
            continue
        if live:
            fed.append((len(seqs), seq.last_step))
            token_ids_append(0)
        else:
            token_ids_append(outputs[-1])
        index = num_outputs + live
        slots = plan_slots(state, seq, position, index, token_budget) if speculating else 0
        if slots:
            spec.append((len(seqs), slots))
            token_ids.extend([PROPOSE] * slots)
            seq.spec_row = slots
            state.spec_rows += 1
        seqs_append(seq)
        positions_append(position)
        sample_indices_append(index)
        seq.num_computed = position + 1 + slots
        seq.inflight = inflight + 1
        seq.last_step = step_id
        token_budget -= 1 + slots
    if not looked_at_all and not seqs:
        return None, None, left_out
    fed_from = [NOT_FED] * len(seqs)
    for row, source in fed:
        fed_from[row] = source
    block_starts = [seq.sent_blocks for seq in seqs]
    num_new_blocks = [len(seq.block_ids) - sent for seq, sent in zip(seqs, block_starts, strict=True)]
    new_block_ids: list[int] = []
    if any(num_new_blocks):
        for seq, sent, grown in zip(seqs, block_starts, num_new_blocks, strict=True):
            if grown:
                new_block_ids += seq.block_ids[sent:]
                seq.sent_blocks = sent + grown
    num_tokens = [1] * len(seqs)
    for row, slots in spec:
        num_tokens[row] += slots
    planned = StepColumns(
        step_id, seqs, positions, num_tokens, token_ids, fed_from, sample_indices, block_starts, num_new_blocks,
        new_block_ids, list(seqs), list(sample_indices),
        [position + n for position, n in zip(positions, num_tokens, strict=True)] if spec else
        [position + 1 for position in positions],
    )
    planned.ending = [
        i for i, (seq, index) in enumerate(zip(seqs, sample_indices, strict=True))
        if index + 1 >= stop_rule(config, seq)[1]
    ]
    return planned, prefilling if looked_at_all else None, left_out


def plan_prefill(
    state: CoreState, ctx: TickContext, planned: StepColumns, prefilling: list[Seq] | None, token_budget: int
) -> tuple[list[Seq], list[Seq]]:
    """Add prefill chunks, in running order, to the step; returns (still prefilling, completed by this step).

    With ``prefilling`` None (the decode pass ran out of token budget) nothing is planned.
    """
    if prefilling is None:
        return [], []
    config = state.config
    block_size = config.block_size
    step_id = planned.step_id
    is_running = Status.RUNNING
    prefill_budget = min(config.max_prefill_tokens, token_budget)
    remaining: list[Seq] = []
    completed: list[Seq] = []
    for i, seq in enumerate(prefilling):
        if prefill_budget <= 0:
            remaining += [s for s in prefilling[i:] if s.status is is_running]
            break
        if seq.status is not is_running:
            continue
        if seq.num_computed >= seq.prefill_target:
            completed.append(seq)
            continue
        fresh = not seq.first_planned
        if fresh:
            _claim_prefix(state, seq)
        start = seq.num_computed
        catch_up = seq.catch_up
        # A catch-up row runs through the pending token and samples, as a decode row does.
        target = seq.num_tokens if catch_up else seq.prefill_target
        count = min(target - start, prefill_budget)
        if not ensure_blocks(state, ctx, seq, (start + count - 1) // block_size + 1, step_id):
            if fresh and seq.status is Status.RUNNING:
                _unclaim_prefix(state, seq)
            if seq.status is is_running:
                remaining.append(seq)
            continue
        end = start + count
        planned.seqs.append(seq)
        planned.positions.append(start)
        planned.num_tokens.append(count)
        planned.token_ids.extend(seq.tokens(start, end))
        planned.fed_from.append(NOT_FED)
        if end == len(seq.prompt) and not seq.outputs:
            planned.sample_indices.append(0)
            if stop_rule(config, seq)[1] <= 1:
                planned.ending.append(len(planned.samplers))
            planned.samplers.append(seq)
            planned.sampler_indices.append(0)
            seq.inflight += 1
        elif catch_up and end == target:
            index = len(seq.outputs)
            planned.sample_indices.append(index)
            if index + 1 >= stop_rule(config, seq)[1]:
                planned.ending.append(len(planned.samplers))
            planned.samplers.append(seq)
            planned.sampler_indices.append(index)
            seq.inflight += 1
        else:
            planned.sample_indices.append(NO_SAMPLE)
        if catch_up:
            seq.catch_up = max(0, target - 1 - end)
            ctx.lane_broken = True
        planned.kv_ends.append(end)
        seq.num_computed = end
        seq.last_step = step_id
        prefill_budget -= count
        _add_delta(seq, planned)
        if config.prefix_caching:
            planned.registered += cache_full_blocks(state, seq, end)
        (completed if end >= seq.prefill_target else remaining).append(seq)
    return remaining, completed


def emit_step(state: CoreState, ctx: TickContext, planned: StepColumns) -> RunStep:
    """Record the planned step as in flight and build its ``RunStep``."""
    seqs = planned.seqs
    request_ids = [seq.request_id for seq in seqs]
    samplers = planned.samplers
    # Equal lengths mean every row samples (decode rows always do), so the two id lists are the same.
    sampler_ids = request_ids if len(samplers) == len(seqs) else [seq.request_id for seq in samplers]
    state.next_step_id += 1
    state.steps.append(
        InflightStep(planned.step_id, seqs, samplers, planned.sampler_indices, planned.kv_ends, planned.registered,
                     sampler_ids, planned.ending)
    )
    ctx.planned_step = True
    return RunStep(
        planned.step_id,
        request_ids,
        planned.positions,
        planned.num_tokens,
        planned.token_ids,
        planned.fed_from,
        planned.sample_indices,
        planned.block_starts,
        planned.num_new_blocks,
        planned.new_block_ids,
    )


def _add_delta(seq: Seq, planned: StepColumns) -> None:
    """Record a row's block-table delta: only the blocks appended since its last step travel in ``RunStep``."""
    table = seq.block_ids
    sent = seq.sent_blocks
    planned.block_starts.append(sent)
    planned.num_new_blocks.append(len(table) - sent)
    if len(table) > sent:
        planned.new_block_ids.extend(table[sent:])
        seq.sent_blocks = len(table)


def _claim_prefix(state: CoreState, seq: Seq) -> None:
    """On a fresh sequence's first chunk: reuse the cached blocks of its prompt's longest cached prefix.

    Looked up now, not at admission, so that a request admitted in the same tick as an identical one hits the
    blocks the other's chunk registers earlier in this very plan. (The executor writes every row's KV for a
    layer before any row attends, so a hit on a block filled in the same step is safe.)
    """
    seq.first_planned = True
    if not state.config.prefix_caching or seq.block_ids or not may_hit_cache(seq):
        return
    hits = state.pool.lookup(full_block_hashes(state, seq, len(seq.prompt) - 1))
    if not hits:
        return
    state.pool.claim(hits)
    seq.block_ids = list(hits)
    seq.num_computed = seq.kv_settled = seq.cached_prompt_tokens = len(hits) * state.config.block_size


def _unclaim_prefix(state: CoreState, seq: Seq) -> None:
    """Undo ``_claim_prefix`` after a failed allocation: the hit blocks' refcounts return to what they were."""
    state.pool.release(seq.block_ids)
    seq.block_ids = []
    seq.num_computed = seq.kv_settled = seq.cached_prompt_tokens = 0
    seq.first_planned = False
