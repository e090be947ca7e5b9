"""The decode lane: most steady-state steps, derived from the previous step in bulk.

Why: in the steady state nearly every step is the previous one again, one token further. The same sequences
decode in the same order, each at the next position and output index, each fed its own last token (or, running
ahead, the token of the step in flight). The general plan (``planner``) finds that out one sequence at a time,
with a dozen attribute reads, tests and appends per row. It is the hot loop of a tick. The lane keeps the
newest step's decode rows as columns (``state.DecodeLane``) and derives the next step's with list operations
that run at C speed. Only the few rows that need a new KV block are handled one by one.

It is an optimisation, never a second set of rules: it plans exactly what the general plan would, or stands
down and lets the general plan run (which rebuilds it). It holds only while nothing but these happened since
the step it describes:

- members finished (they are dropped);
- prefills completed in that step (they join at the end, if that is where running order puts them);
- sequences were admitted or resumed (they are prefilling, and appended to ``prefilling``).

Anything else stands it down: a preemption or swap (the preempting code clears ``state.lane``), a failed step,
a sequence that joins ``running`` already decoding (``CoreState.join_running``), a member that would need a
block the free list cannot give, a decode sequence that got no row and is still running, more decode rows than
the token budget, or thinking markers (whose budget forces tokens). The differential test
(``tests/test_core_decode_lane.py``) runs random workloads with and without the lane and compares every output byte.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import floordiv, ge

from tickloom.engine.core.columns import StepColumns
from tickloom.engine.core.finish import stop_rule
from tickloom.engine.core.state import CoreState, DecodeLane, Seq, find_in_run_order
from tickloom.engine.core.status import Status
from tickloom.events import NOT_FED


def plan_lane_decode(state: CoreState, lane: DecodeLane) -> StepColumns | None:
    """The next step's decode rows, derived from ``lane``; None if the lane must stand down.

    None is returned before anything the general plan would observe has changed. Otherwise the lane has moved
    on to the new step, except for ``prefilling`` and ``joining``, which ``advance_lane`` sets once the prefill
    chunks are planned.
    """
    config = state.config
    step_id = state.next_step_id
    steps = state.steps
    if lane.step_id != step_id - 1 or (steps and steps[-1].step_id != lane.step_id):
        return None
    running = Status.RUNNING
    for seq in lane.left_out:
        if seq.status is running:
            return None
    if state.finished_in_running:
        _drop_finished(lane, state.finished_in_running)
    fed = bool(steps)
    if not fed and lane.token_ids_step != lane.step_id:
        return None  # settling the step hands the lane its tokens; without them, the general plan reads them
    left_out: list[Seq] = []
    # Members whose last token by length is the one in flight get no row (``planner.can_run_ahead``). Without
    # a step in flight that token has settled and finished them, so a running one means the lane is wrong.
    for seq in lane.last_rows.pop(step_id - 1, ()):
        if seq.status is running:
            if not fed:
                return None
            _remove(lane, find_in_run_order(lane.seqs, seq))
            left_out.append(seq)
    if lane.joining and not _join(state, lane, step_id, 1 if fed else 0, left_out):
        return None
    seqs = lane.seqs
    rows = len(seqs)
    if rows > config.max_batch_tokens:
        return None
    positions = lane.positions
    pool = state.pool
    # The rows whose position is past their table, which holds ``sent_blocks`` blocks (``map`` and ``compress`` keep
    # the scan at C speed).
    block_size = config.block_size
    need = list(compress(range(rows), map(ge, map(floordiv, positions, repeat(block_size)), lane.sent_blocks)))
    if len(need) > len(pool.free) + len(pool.cached):
        return None  # a victim would be needed

    # Committed from here on: the step is the lane's.
    state.prune_running()
    sample_indices = lane.sample_indices
    sent_blocks = lane.sent_blocks
    block_starts = list(sent_blocks)
    num_new_blocks = [0] * rows
    new_block_ids: list[int] = []
    free = pool.free
    if len(need) > len(free):
        # The general plan reclaims one block whenever none is free. Reclaiming the shortfall at once evicts
        # the same blocks in the same order and appends them to the free list in that order, so the rows get
        # the same blocks.
        pool.reclaim(len(need) - len(free))
    for i in need:
        # ``BlockPool.allocate(1)``, inlined, in row order. A member's table has been sent whole, so the new
        # block is the row's whole delta.
        block = free.popitem(last=False)[0]
        pool.ref[block] = 1
        seq = seqs[i]
        seq.block_ids.append(block)
        num_new_blocks[i] = 1
        new_block_ids.append(block)
        seq.sent_blocks = sent_blocks[i] = sent_blocks[i] + 1
    next_positions = [position + 1 for position in positions]
    inflight = 2 if fed else 1
    for seq, position in zip(seqs, next_positions, strict=True):
        seq.num_computed = position
        seq.inflight = inflight
        seq.last_step = step_id
    if fed:
        token_ids = [0] * rows
        fed_from = [lane.step_id] * rows
    else:
        token_ids = lane.token_ids
        lane.token_ids = []
        fed_from = [NOT_FED] * rows
    ending = sorted(find_in_run_order(seqs, seq) for seq in lane.last_rows.get(step_id, ()) if seq.status is running)
    lane.step_id = step_id
    lane.positions = next_positions
    lane.sample_indices = [index + 1 for index in sample_indices]
    lane.left_out = left_out
    return StepColumns(
        step_id, list(seqs), positions, [1] * rows, token_ids, fed_from, list(sample_indices), block_starts,
        num_new_blocks, new_block_ids, list(seqs), list(sample_indices), list(next_positions), ending=ending,
    )


def hand_tokens(lane: DecodeLane, step_id: int, token_ids: list[int]) -> None:
    """``settle_step``: the step's sampled tokens, in sampler order. The lane's step samples for its members
    first, in their order, so the first ones are the members' pending tokens."""
    if lane.step_id == step_id:
        lane.token_ids = token_ids[: len(lane.seqs)]
        lane.token_ids_step = step_id


def advance_lane(state: CoreState, lane: DecodeLane, prefilling: list[Seq], completed: list[Seq]) -> None:
    """Reinstate a lane that planned the step, once its prefill chunks are planned too."""
    lane.prefilling = prefilling
    lane.joining = completed
    state.lane = lane


def start_lane(
    state: CoreState, planned: StepColumns, decode_rows: int, prefilling: list[Seq], completed: list[Seq],
    left_out: list[Seq],
) -> None:
    """Build the lane from a step the general plan made (its first ``decode_rows`` rows decode)."""
    seqs = planned.seqs[:decode_rows]
    config = state.config
    indices = [index + 1 for index in planned.sample_indices[:decode_rows]]
    limits = [stop_rule(config, seq)[1] for seq in seqs]
    last_rows: dict[int, list[Seq]] = {}
    next_step = planned.step_id + 1
    for seq, index, limit in zip(seqs, indices, limits, strict=True):
        last_rows.setdefault(next_step + limit - 1 - index, []).append(seq)
    state.lane = DecodeLane(
        step_id=planned.step_id,
        seqs=seqs,
        positions=planned.kv_ends[:decode_rows],
        sample_indices=indices,
        sent_blocks=[seq.sent_blocks for seq in seqs],
        token_ids=[],
        token_ids_step=-1,
        last_rows=last_rows,
        prefilling=prefilling,
        joining=completed,
        left_out=left_out,
    )


def _drop_finished(lane: DecodeLane, finished: list[Seq]) -> None:
    """Remove the members that finished since the lane's step (``finished`` lists every finished running one)."""
    for seq in finished:
        if seq.last_step == lane.step_id:
            i = find_in_run_order(lane.seqs, seq)
            if i >= 0:
                _remove(lane, i)


def _remove(lane: DecodeLane, i: int) -> None:
    del lane.seqs[i], lane.positions[i], lane.sample_indices[i], lane.sent_blocks[i]
    if lane.token_ids_step == lane.step_id:
        del lane.token_ids[i]


def _join(state: CoreState, lane: DecodeLane, step_id: int, inflight: int, left_out: list[Seq]) -> bool:
    """Append the sequences whose prefill completed; False if one cannot join (the lane stands down)."""
    last = lane.seqs[-1]._run_order if lane.seqs else -1
    config = state.config
    for seq in lane.joining:
        if seq.status is not Status.RUNNING:
            continue
        # A resumed sequence's prefill samples nothing, so running ahead it has no token in flight to be fed
        # from; running order must put it after every member; and its table must have been sent whole, as the
        # lane sends only the blocks it adds.
        if (
            seq.inflight != inflight
            or seq._run_order <= last
            or seq.num_computed < seq.prefill_target
            or seq.sent_blocks != len(seq.block_ids)
        ):
            return False
        last = seq._run_order
        index = len(seq.outputs) + seq.inflight
        limit = stop_rule(config, seq)[1]
        if index >= limit:  # running ahead, its token in flight may be its last
            left_out.append(seq)
            continue
        lane.seqs.append(seq)
        lane.positions.append(seq.num_computed)
        lane.sample_indices.append(index)
        lane.sent_blocks.append(seq.sent_blocks)
        if lane.token_ids_step == lane.step_id:
            lane.token_ids.append(seq.outputs[-1])
        lane.last_rows.setdefault(step_id + limit - 1 - index, []).append(seq)
    lane.joining = []
    return True
