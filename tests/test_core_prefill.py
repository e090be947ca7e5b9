"""C02/C03: the prefill pass of a plan (``planner.plan_prefill``), called directly on hand-built states.

These pin what the pass does when a chunk cannot get its blocks: the sequence keeps what it has and waits, the
pass goes on to the next sequence, and only sequences whose whole prefill is planned count as completed.
"""

from __future__ import annotations

from core_state import add_prefilling, add_seq, cache_prefix_of, context, make_core

from tickloom.engine.core.columns import StepColumns
from tickloom.engine.core.planner import plan_prefill
from tickloom.engine.core.status import Status


def _empty_step(step_id: int) -> StepColumns:
    return StepColumns(step_id, [], [], [], [], [], [], [], [], [], [], [], [])


def test_c03_a_chunk_that_cannot_get_a_block_waits_and_the_pass_goes_on() -> None:
    """No free block and no victim (every other sequence has an unsettled step): the stuck sequence keeps its
    blocks and progress for a later plan, and the next sequence, which needs no new block, is still planned."""
    core = make_core(num_blocks=5, block_size=16, max_seq_len=64, max_prefill_tokens=64)
    state = core.state
    state.settled_step = 0
    stuck = add_prefilling(state, "stuck", 48, 16, 1, last_step=1)  # its chunk in step 1 is in flight
    fits = add_prefilling(state, "fits", 30, 16, 2, last_step=1)  # its table already covers its prompt
    holder = add_prefilling(state, "holder", 20, 16, 2, last_step=1)
    assert state.pool.num_free == 0
    planned = _empty_step(2)
    remaining, completed = plan_prefill(state, context(), planned, [stuck, fits, holder], 1000)
    assert stuck.status is Status.RUNNING and len(stuck.block_ids) == 1 and stuck.num_computed == 16
    assert planned.seqs == [fits, holder], "the pass went on past the stuck sequence"
    assert remaining == [stuck] and completed == [fits, holder]


def test_c02_only_a_sequence_whose_whole_prompt_is_planned_is_completed() -> None:
    core = make_core(num_blocks=16, block_size=16, max_seq_len=240, max_prefill_tokens=32)
    state = core.state
    short = add_prefilling(state, "short", 20, 0, 0, last_step=-1)
    long = add_prefilling(state, "long", 100, 0, 0, last_step=-1)
    planned = _empty_step(0)
    remaining, completed = plan_prefill(state, context(), planned, [short, long], 1000)
    assert [(seq.request_id, count) for seq, count in zip(planned.seqs, planned.num_tokens, strict=True)] == [
        ("short", 20), ("long", 12)], "the 32-token prefill budget is shared in running order"
    assert completed == [short] and remaining == [long]


def test_c18_a_fresh_sequence_preempted_by_its_own_chunk_keeps_its_cached_prompt_count() -> None:
    """A fresh sequence claims its cached prefix, then its chunk needs a block the pool cannot give and it is
    its own victim: preemption takes its blocks; the prompt tokens it found cached stay counted (as vLLM's
    ``num_cached_tokens``, set the first time a request is scheduled)."""
    core = make_core(num_blocks=5, block_size=16, max_seq_len=64, max_prefill_tokens=64)
    state = core.state
    seq = add_seq(state, "fresh", 40)
    assert len(cache_prefix_of(state, seq, 32)) == 2  # its first two blocks are cached
    other = add_prefilling(state, "other", 40, 16, 3, last_step=0)
    state.settled_step = -1  # other's chunk is in flight: not a victim
    planned = _empty_step(1)
    remaining, completed = plan_prefill(state, context(), planned, [seq, other], 1000)
    assert seq.status is Status.PREEMPTED and seq.block_ids == [] and not seq.first_planned
    assert seq.cached_prompt_tokens == 32
    assert planned.seqs == [other] and remaining == [] and completed == [other]


def test_c03_after_its_first_chunk_a_sequence_is_no_longer_fresh() -> None:
    """Its first chunk planned, a sequence whose next chunk cannot get a block keeps that chunk's blocks: only a
    fresh sequence's claimed prefix is given back when its first chunk fails."""
    core = make_core(num_blocks=5, block_size=16, max_seq_len=64, max_prefill_tokens=16)
    state = core.state
    seq = add_seq(state, "long", 48)
    add_prefilling(state, "holder", 40, 16, 3, last_step=0)
    plan_prefill(state, context(), _empty_step(0), [seq], 1000)
    assert seq.first_planned and len(seq.block_ids) == 1 and seq.num_computed == 16
    add_prefilling(state, "holder2", 10, 0, 1, last_step=0)  # the last free block; nothing has settled
    assert state.pool.num_free == 0 and state.settled_step == -1
    remaining, _ = plan_prefill(state, context(), _empty_step(1), [seq], 1000)
    assert remaining == [seq] and len(seq.block_ids) == 1 and seq.num_computed == 16
