"""C05–C10: KV exhaustion, victims, immunity, requeue and resume, swap-out and swap-in."""

from __future__ import annotations

from core_harness import Harness, arrival
from core_state import add_seq, add_swapped, cache_prefix_of, cache_unrelated, context, hold_blocks, make_core
from test_core_golden import unpressured_output

from tickloom.engine.core import CoreConfig
from tickloom.engine.core.apply import apply_inputs
from tickloom.engine.core.preemption import choose_victim
from tickloom.engine.core.status import Status
from tickloom.engine.core.tick_end import resume_preempted, retire_finished, swap_in
from tickloom.events import DropSpill, EmitTokens, Finish, Preempted, RunStep, SpillOut, SwapIn, SwapInFailed


def test_c05_victim_least_important_then_fewest_generated_then_latest() -> None:
    core = make_core(num_blocks=64, max_seq_len=128)
    state = core.state
    # Admission order a, b, c; the 3-token row is not the latest admitted, so the rule, not recency, picks it.
    add_seq(state, "a", 10, outputs=7)
    add_seq(state, "b", 10, outputs=3)
    add_seq(state, "c", 10, outputs=12)
    victim = choose_victim(state, step_id=0)
    assert victim is not None and victim.request_id == "b"
    add_seq(state, "late", 10, outputs=3)
    victim = choose_victim(state, step_id=0)
    assert victim is not None and victim.request_id == "late", "equal outputs: the latest admitted"
    add_seq(state, "unimportant", 10, outputs=50, priority=5)
    victim = choose_victim(state, step_id=0)
    assert victim is not None and victim.request_id == "unimportant", "a higher priority value goes first"


def test_c05_never_a_row_of_an_unsettled_step() -> None:
    core = make_core(num_blocks=64, max_seq_len=128)
    state = core.state
    add_seq(state, "busy", 10, outputs=1).last_step = 3
    state.settled_step = 2
    add_seq(state, "planned", 10, outputs=1).last_step = 4
    assert choose_victim(state, step_id=4) is None


def test_c05_exhaustion_reclaims_cache_before_preempting() -> None:
    config = CoreConfig(num_blocks=8, block_size=16, max_seq_len=64)
    h = Harness(config)
    h.step(arrival("r0", 33, 1))
    h.run()
    pool = h.core.state.pool
    r0_cached = list(pool.cached)
    r0_hashes = [pool.hash_of[b] for b in r0_cached]
    assert len(r0_cached) == 2
    h.step(arrival("r1", 15, 40), arrival("r2", 15, 40))
    h.run()
    assert not h.commands(Preempted), "the cached blocks are reclaimed instead"
    given = {b for _, step in h.commands(RunStep) for _, blocks in _new_blocks_by_row(step) for b in blocks
             if step.step_id > 0}
    assert set(r0_cached) <= given, "r0's cached blocks went to r1 and r2"
    assert pool.lookup(r0_hashes) == [], "and left the prefix cache"  # type: ignore[arg-type]
    assert [h.reason("r1"), h.reason("r2")] == ["length", "length"]


def test_c05_victim_stream_receives_nothing_at_preemption() -> None:
    h = Harness(CoreConfig(num_blocks=6, block_size=16, max_seq_len=64))
    h.step(arrival("r1", 15, 40), arrival("r2", 15, 40), arrival("r3", 15, 40))
    h.run()
    tick, first = h.commands(Preempted)[0]
    same_tick = [c for t, c in h.commands() if t == tick and not isinstance(c, EmitTokens | RunStep | Preempted)]
    assert all(getattr(c, "request_id", None) != first.request_id for c in same_tick)
    assert h.output(first.request_id) == unpressured_output(first.request_id, 15, 40)


def test_c06_resumed_sequence_is_immune_unless_all_are() -> None:
    core = make_core(num_blocks=64, max_seq_len=256, preempt_immunity_tokens=64)
    state = core.state
    resumed = add_seq(state, "resumed", 10, outputs=2)
    resumed.immune_until = 2 + 64
    add_seq(state, "other", 10, outputs=30)
    victim = choose_victim(state, 0)
    assert victim is not None and victim.request_id == "other", "the resumed (fewest tokens) one is skipped"
    state.seqs["other"].immune_until = 30 + 64
    victim = choose_victim(state, 0)
    assert victim is not None and victim.request_id == "resumed", "all immune: the usual order applies"
    resumed.outputs += [1] * 64
    state.seqs["other"].immune_until = -1
    victim = choose_victim(state, 0)
    assert victim is not None and victim.request_id == "other"


def test_c07_requeue_re_prefills_exactly_the_history() -> None:
    h = Harness(CoreConfig(num_blocks=6, block_size=16, max_seq_len=64))
    h.step(arrival("r1", 15, 40), arrival("r2", 15, 40), arrival("r3", 15, 40))
    h.run()
    preempt_tick = next(t for t, c in h.commands(Preempted) if c.request_id == "r3")
    rows = [
        (s.positions[i], s.num_tokens[i], s.sample_indices[i], s.token_ids, s, i)
        for t, s in h.commands(RunStep)
        if t > preempt_tick
        for i, rid in enumerate(s.request_ids)
        if rid == "r3"
    ]
    streamed_at_preempt = len([1 for t, c in h.commands(EmitTokens) if t <= preempt_tick for r in c.request_ids
                               if r == "r3"])
    history = h.core.state.seqs.get("r3")
    assert history is None  # finished; rebuild its tokens from the stream
    tokens = arrival("r3", 15).prompt_token_ids + h.tokens["r3"]
    pending = 15 + streamed_at_preempt - 1
    covered = []
    for position, count, sample_index, token_ids, step, i in rows:
        start = sum(step.num_tokens[:i])
        assert token_ids[start : start + count] == tokens[position : position + count] or step.fed_from[i] != -1
        covered.append((position, count, sample_index))
        if sample_index != -1:
            break
    *prefill, decode = covered
    assert prefill[0][0] % 16 == 0 and prefill[-1][0] + prefill[-1][1] == pending, "history minus pending token"
    assert all(s == -1 for _, _, s in prefill), "nothing is sampled twice"
    assert decode == (pending, 1, streamed_at_preempt), "then the pending token is fed and samples the next"
    assert h.output("r3") == unpressured_output("r3", 15, 40)


def test_c08_resume_with_reclaimable_cache() -> None:
    core = make_core(num_blocks=53, block_size=16, max_seq_len=128)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 40, outputs=1), 3)
    cache_unrelated(state, 50)
    assert state.pool.num_free == 0 and state.pool.num_cached == 50
    parked = add_seq(state, "parked", 20, outputs=13, status=Status.PREEMPTED)  # history 32 tokens
    ctx = context()
    resume_preempted(state, ctx)
    assert parked.status is Status.RUNNING and len(parked.block_ids) == 3 and parked.num_computed == 0
    assert state.pool.num_free == 1, "need + 1 = 4 were made free; 3 taken"
    assert parked.immune_until == 13 + 64


def test_c08_stays_parked_without_room() -> None:
    core = make_core(num_blocks=10, block_size=16, max_seq_len=128)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 100, outputs=1), 10)
    parked = add_seq(state, "parked", 20, outputs=13, status=Status.PREEMPTED)
    ctx = context()
    resume_preempted(state, ctx)
    assert parked.status is Status.PREEMPTED and ctx.commands == []


def test_c08_own_prefix_counts_and_is_never_reclaimed() -> None:
    core = make_core(num_blocks=10, block_size=16, max_seq_len=128)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 80, outputs=1), 6)
    parked = add_seq(state, "parked", 30, outputs=11, status=Status.PREEMPTED)  # history 40: needs 3, wants 4
    own = cache_prefix_of(state, parked, 40)
    cache_unrelated(state, 1)
    assert len(own) == 2 and state.pool.num_free == 1 and state.pool.num_cached == 3
    ctx = context()
    resume_preempted(state, ctx)
    assert parked.status is Status.RUNNING
    assert parked.block_ids[:2] == own and len(parked.block_ids) == 3
    assert parked.num_computed == 32, "its cached prefix is reused"
    assert state.pool.num_cached == 0 and state.pool.num_free == 1, "only the unrelated block was evicted"


def test_c09_swap_out_victim_then_blocks_reused_after() -> None:
    config = CoreConfig(num_blocks=6, block_size=16, max_seq_len=64, spill_enabled=True)
    h = Harness(config)
    h.step(arrival("r1", 15, 40), arrival("r2", 15, 40), arrival("r3", 15, 40))
    h.run()
    commands = [c for _, c in h.commands()]
    spill_at = next(i for i, c in enumerate(commands) if isinstance(c, SpillOut))
    spill = commands[spill_at]
    assert isinstance(spill, SpillOut) and spill.request_id == "r3"
    assert commands[spill_at - 1] == Preempted("r3", "swap")
    owners = [(i, owner) for i, c in enumerate(commands) if isinstance(c, RunStep)
              for owner, blocks in _new_blocks_by_row(c) if set(blocks) & set(spill.block_ids)]
    assert all(owner == "r3" for i, owner in owners if i < spill_at)
    assert any(owner != "r3" for i, owner in owners if i > spill_at), "another sequence gets them, after SpillOut"
    assert h.commands(SwapIn)
    for rid in ("r1", "r2", "r3"):
        assert h.reason(rid) == "length" and h.output(rid) == unpressured_output(rid, 15, 40)


def _new_blocks_by_row(step: RunStep) -> list[tuple[str, list[int]]]:
    rows, offset = [], 0
    for rid, n in zip(step.request_ids, step.num_new_blocks, strict=True):
        rows.append((rid, step.new_block_ids[offset : offset + n]))
        offset += n
    return rows


def test_c09_failed_spill_falls_back_to_requeue() -> None:
    config = CoreConfig(num_blocks=6, block_size=16, max_seq_len=64, spill_enabled=True)
    h = Harness(config, spill_fails={"r3"})
    h.step(arrival("r1", 15, 40), arrival("r2", 15, 40), arrival("r3", 15, 40))
    h.run()
    assert ("r3", "swap") in [(c.request_id, c.mode) for _, c in h.commands(Preempted)]
    assert not [c for _, c in h.commands(SwapIn) if c.request_id == "r3"], "it came back by recompute"
    assert DropSpill("r3") in [c for _, c in h.commands(DropSpill)]
    for rid in ("r1", "r2", "r3"):
        assert h.reason(rid) == "length" and h.output(rid) == unpressured_output(rid, 15, 40)


def test_c10_swap_in_reclaims_then_takes_first_that_fits() -> None:
    core = make_core(num_blocks=12, block_size=16, max_seq_len=128, max_batch_size=8)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 100, outputs=1), 7)
    big = add_seq(state, "big", 60, outputs=5, status=Status.SWAPPED)  # 64 KV tokens: 5 blocks
    small = add_seq(state, "small", 20, outputs=5, status=Status.SWAPPED)  # 24 KV tokens: 2 blocks
    for seq in (big, small):
        seq.spill_tokens, seq.swap_ready, seq.has_spill = seq.num_tokens - 1, True, True
    cache_unrelated(state, 4)
    assert state.pool.num_free == 1
    ctx = context()
    swap_in(state, ctx)
    swaps = [c for c in ctx.commands if isinstance(c, SwapIn)]
    assert [s.request_id for s in swaps] == ["small"], "the first in list order that fits after reclaiming"
    assert small.status is Status.RUNNING and len(small.block_ids) == 2
    assert big.status is Status.SWAPPED, "big still does not fit: reclaim passes free nothing more"
    assert state.pool.num_cached == 0


def test_c10_swap_in_failure_ends_only_that_request() -> None:
    core = make_core(num_blocks=12, block_size=16, max_seq_len=128)
    state = core.state
    lost = add_seq(state, "lost", 20, outputs=5, status=Status.SWAPPED)
    lost.spill_tokens, lost.swap_ready, lost.has_spill = 24, True, True
    ctx = context()
    swap_in(state, ctx)
    assert lost.status is Status.RUNNING and state.pool.num_free == 10
    bystander = add_seq(state, "bystander", 20, outputs=2)
    hold_blocks(state, bystander, 2)
    ctx = context()
    apply_inputs(state, ctx, [SwapInFailed("lost", "checksum mismatch in spill file")])
    retire_finished(state, ctx, state.finishing)
    state.finishing = []
    finish = next(c for c in ctx.commands if isinstance(c, Finish))
    assert finish.request_id == "lost" and finish.reason == "error"
    assert finish.error == "swap-in failed: checksum mismatch in spill file"
    assert DropSpill("lost") in ctx.commands
    assert state.pool.num_free == 10 and bystander.status is Status.RUNNING


def test_c07_a_requeued_sequence_sends_its_new_block_table_whole() -> None:
    """Preemption frees the sequence's blocks, so the executor's table for it is stale: the first row after the
    resume must start the table at 0 and send every block, and each later row only the blocks added since."""
    h = Harness(CoreConfig(num_blocks=6, block_size=16, max_seq_len=64))
    h.step(arrival("r1", 15, 40), arrival("r2", 15, 40), arrival("r3", 15, 40))
    h.run()
    preempt_tick = next(t for t, c in h.commands(Preempted) if c.request_id == "r3")
    rows = [(s.block_starts[i], s.num_new_blocks[i]) for t, s in h.commands(RunStep) if t > preempt_tick
            for i, rid in enumerate(s.request_ids) if rid == "r3"]
    assert rows[0][0] == 0 and rows[0][1] >= 1, rows[:3]
    sent = 0
    for start, new in rows:
        assert start == sent, "each row continues the table where the previous one left it"
        sent += new


def test_c10_swap_in_reclaims_only_the_shortfall() -> None:
    """The smallest candidate needs 2 blocks and 1 is free: exactly one cached block is evicted, the LRU one."""
    core = make_core(num_blocks=12, block_size=16, max_seq_len=128, max_batch_size=8)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 100, outputs=1), 7)
    small = add_swapped(state, "small", 20)  # 24 KV tokens: 2 blocks
    cache_unrelated(state, 4)
    lru_first = list(state.pool.cached)
    assert state.pool.num_free == 1
    swap_in(state, context())
    assert small.status is Status.RUNNING
    assert list(state.pool.cached) == lru_first[1:], "one block evicted, the least recently used"


def test_c10_swap_in_with_exactly_enough_free_blocks_evicts_nothing() -> None:
    core = make_core(num_blocks=12, block_size=16, max_seq_len=128, max_batch_size=8)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 100, outputs=1), 6)
    small = add_swapped(state, "small", 20)
    cache_unrelated(state, 4)
    assert state.pool.num_free == 2
    swap_in(state, context())
    assert small.status is Status.RUNNING and state.pool.num_cached == 4


def test_c10_swap_in_fills_the_batch_exactly() -> None:
    """max_batch_size 3 with one running: two swapped sequences come back in the same tick, a third does not."""
    core = make_core(num_blocks=20, block_size=16, max_seq_len=128, max_batch_size=3)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 20, outputs=1), 2)
    first, second, third = (add_swapped(state, name, 20) for name in ("s1", "s2", "s3"))
    ctx = context()
    swap_in(state, ctx)
    assert [c.request_id for c in ctx.commands if isinstance(c, SwapIn)] == ["s1", "s2"]
    assert first.status is second.status is Status.RUNNING and third.status is Status.SWAPPED


def test_c08_a_whole_cached_history_resumes_with_only_its_pending_token_to_feed() -> None:
    """A history of 32 tokens (2 full blocks), all cached: both blocks are reused, so the resumed sequence computes
    nothing again (for a fresh prompt the last token is always computed; a history's pending token is fed)."""
    core = make_core(num_blocks=10, block_size=16, max_seq_len=128)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 80, outputs=1), 6)
    parked = add_seq(state, "parked", 20, outputs=13, status=Status.PREEMPTED)  # history 32 = prompt + 12 outputs
    own = cache_prefix_of(state, parked, 32)
    assert len(own) == 2
    resume_preempted(state, context())
    assert parked.status is Status.RUNNING and parked.block_ids[:2] == own and parked.num_computed == 32


def test_c08_resume_reclaims_only_the_shortfall() -> None:
    core = make_core(num_blocks=60, block_size=16, max_seq_len=128)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 40, outputs=1), 8)
    cache_unrelated(state, 50)
    assert state.pool.num_free == 2
    parked = add_seq(state, "parked", 20, outputs=13, status=Status.PREEMPTED)  # wants need + 1 = 4
    resume_preempted(state, context())
    assert parked.status is Status.RUNNING and state.pool.num_cached == 48, "2 free + 2 evicted make the 4"


def test_c08_a_request_for_prompt_logprobs_resumes_without_cache_hits_before_its_first_token() -> None:
    from tickloom.events import SamplingSpec

    core = make_core(num_blocks=10, block_size=16, max_seq_len=128)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 80, outputs=1), 6)
    parked = add_seq(state, "parked", 40, status=Status.PREEMPTED)
    parked.params = SamplingSpec(max_tokens=8, prompt_logprobs=1)
    assert len(cache_prefix_of(state, parked, 32)) == 2
    resume_preempted(state, context())
    assert parked.status is Status.RUNNING and parked.num_computed == 0, "every prompt position is computed"
