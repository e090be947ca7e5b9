"""Speculative decoding in the core: proposal slots on decode rows, settled to the accepted count.

The core reserves slots (``PROPOSE``) at the end of a decode row; the executor's proposer fills them and the step
reports the tokens that followed right proposals as extra tokens. Each rule of ``engine.core.speculation`` has a
test here that fails if that rule alone broke, driving ``SchedulerCore`` by hand; the blasts at the end run every
actor's timing at random with the oracle accepting a random number of proposals, and check on the way that no
rejected proposal's KV is ever attended to, cached or spilled (``OracleExecutor.block_size``).
"""

from __future__ import annotations

import msgspec
import pytest
from core_state import add_seq, hold_blocks, make_core
from test_core_blast import blast_config, random_config, run_blast
from test_core_extras import PROMPT, Driver, _arrive, _core

from tickloom.engine.core.blocks import blocks_for
from tickloom.engine.core.context import TickContext
from tickloom.engine.core.errors import InvariantViolation
from tickloom.engine.core.preemption import take_off_device
from tickloom.engine.core.speculation import RETRY_AFTER
from tickloom.events import (
    NOT_FED,
    PROPOSE,
    RequestArrived,
    RunStep,
    SamplingSpec,
    SpillOut,
    StepDone,
    StepFailed,
    Structured,
    SwapIn,
)
from tickloom.replay.oracle import OracleExecutor

P = len(PROMPT)  # 20: the pending token of output 0 sits at position 20


def _spec(k: int = 4, depth: int = 1, **kw: object) -> Driver:
    return Driver(_core(depth, speculative_tokens=k, **kw))


def _started(k: int = 4, depth: int = 1, **kw: object) -> Driver:
    """"r" prefilled, output 0 = 100 settled; its first decode row is step 1."""
    max_tokens = kw.pop("max_tokens", 50)
    d = _spec(k, depth, **kw)
    d.run(_arrive(max_tokens))  # type: ignore[arg-type]
    d.done(0, 100)
    return d


def test_a_decode_row_carries_k_proposal_slots_after_its_input() -> None:
    d = _started()
    assert d.row(1) == (P, 5, [100, PROPOSE, PROPOSE, PROPOSE, PROPOSE], NOT_FED, 1)
    seq = d.core.state.seqs["r"]
    assert (seq.num_computed, seq.spec_row, d.core.state.spec_rows) == (P + 5, 4, 1)


def test_the_prefill_row_has_no_slots() -> None:
    d = _spec()
    d.run(_arrive())
    assert PROPOSE not in d.steps[0].token_ids


def test_accepted_tokens_are_committed_in_order_and_the_kv_rolls_back_to_them() -> None:
    d = _started()
    d.done(1, 101, [102, 103])  # two of four proposals right: outputs 1, 2, 3
    assert d.emitted[1:] == [(1, 101), (2, 102), (3, 103)]
    seq = d.core.state.seqs["r"]
    # KV through output 2 (position 22, the second accepted proposal); output 3 is the pending token, the next
    # row's input at position 23 (planned in the same tick), with no catch-up.
    assert (seq.kv_settled, seq.catch_up) == (P + 3, 0)
    assert d.row(2)[:2] == (P + 3, 5) and d.row(2)[2][0] == 103 and d.row(2)[4] == 4
    assert seq.num_computed == P + 3 + 5


def test_no_accepted_proposal_settles_like_a_plain_decode_row() -> None:
    d = _started()
    d.done(1, 101, [])
    seq = d.core.state.seqs["r"]
    assert seq.kv_settled == P + 1
    assert d.row(2)[0] == P + 1 and d.row(2)[2][0] == 101


def test_more_accepted_than_slots_is_an_invariant_violation() -> None:
    d = _started(k=2)
    with pytest.raises(InvariantViolation, match="2 proposal slots"):
        d.done(1, 101, [102, 103, 104])


@pytest.mark.parametrize(("limit", "slots"), [(dict(max_tokens=3), 1), (dict(max_tokens=2), 0)])
def test_slots_stop_at_max_tokens(limit: dict[str, int], slots: int) -> None:
    """Output 1 is sampled by the row; an accepted proposal may only be an output below max_tokens."""
    d = _spec(4)
    d.run(_arrive(**limit))
    d.done(0, 100)
    assert d.row(1)[1] == 1 + slots


def test_slots_stop_at_the_context_limit() -> None:
    d = _spec(4, max_seq_len=P + 3)
    d.run(_arrive())
    d.done(0, 100)
    assert d.row(1)[1] == 1 + 1  # output 1 at position 20 sampled; output 2 (position 21) is the last one


def test_slots_are_counted_in_the_token_budget() -> None:
    d = _spec(8, max_batch_tokens=6, max_batch_size=2, max_prefill_tokens=6, num_blocks=40, max_seq_len=64)
    d.run(RequestArrived("r", PROMPT[:4], SamplingSpec(max_tokens=50), seed=7))
    d.done(0, 100)
    assert d.row(1)[1] == 6


def test_slots_take_only_blocks_the_free_list_can_spare() -> None:
    """Row at position 20 with a table of 2 blocks of 16: slots past position 31 need a third block, which is taken
    only if a free block is left for every running sequence's next row."""
    d = _started(k=16)
    assert d.row(1)[1] == 17  # positions 20..36: a third block from the free list
    d2 = _started(k=16, num_blocks=3, max_seq_len=40)  # one block free, one running sequence: not spared
    assert d2.row(1)[1] == 1 + 32 - 1 - P  # the slots end with the table's last position, 31


def test_no_slots_while_more_sequences_run_than_speculative_max_running() -> None:
    d = _spec(4, speculative_max_running=1)
    d.run(_arrive(), RequestArrived("s", PROMPT, SamplingSpec(max_tokens=50), seed=8))
    step = d.steps[0]
    d.run(StepDone(0, ["r", "s"], [100, 200]))
    assert PROPOSE not in d.steps[1].token_ids  # two running
    alone = _started(4, speculative_max_running=1)
    assert alone.row(1)[1] == 5  # one running
    assert step.request_ids == ["r", "s"]


def test_at_depth_2_no_row_is_fed_from_a_row_with_slots() -> None:
    d = _started(depth=2)
    d.run()  # a tick with step 1 in flight: running ahead would plan step 2 fed from it
    assert 2 not in d.steps
    d.done(1, 101, [102])
    assert d.row(2)[0] == P + 2 and d.row(2)[3] == NOT_FED


def test_all_accepted_doubles_k_and_none_halves_it() -> None:
    d = _started(k=8)
    seq = d.core.state.seqs["r"]
    assert seq.spec_k == 8
    d.done(1, 101, [])
    assert seq.spec_k == 4 and d.row(2)[1] == 5
    d.done(2, 102, [103, 104, 105, 106])
    assert seq.spec_k == 8 and d.row(3)[1] == 9
    d.done(3, 107, [108])  # some accepted: k stays
    assert seq.spec_k == 8


def _done_proposed(d: Driver, step_id: int, token: int, extras: list[int], proposed: list[int]) -> None:
    d.run(StepDone(step_id, ["r"], [token], extra_token_ids=[extras] if extras else None, proposed=proposed))


def test_a_row_whose_proposer_filled_no_slot_leaves_k_as_it_is() -> None:
    """Prompt lookup that finds no match is no rejection: k stays, and the next row has its slots."""
    d = _started(k=4)
    seq = d.core.state.seqs["r"]
    for step in (1, 2, 3):
        _done_proposed(d, step, 100 + step, [], [0])
        assert seq.spec_k == 4 and d.row(step + 1)[1] == 5
    assert seq.kv_settled == P + 3  # each row settled like a plain decode row


def test_a_row_that_proposed_and_accepted_none_halves_k() -> None:
    d = _started(k=4)
    _done_proposed(d, 1, 101, [], [1])
    assert d.core.state.seqs["r"].spec_k == 2 and d.row(2)[1] == 3


def test_a_row_that_filled_fewer_slots_and_accepted_all_of_them_keeps_k() -> None:
    """Doubling needs every slot accepted; a proposer that ran out of tokens is no evidence for more."""
    d = _started(k=8)
    seq = d.core.state.seqs["r"]
    _done_proposed(d, 1, 101, [], [2])
    assert seq.spec_k == 4
    _done_proposed(d, 2, 102, [103, 104], [2])
    assert seq.spec_k == 4 and d.emitted[-2:] == [(3, 103), (4, 104)]


def test_without_a_proposed_column_every_slot_counts_as_filled() -> None:
    """Logs from before ``StepDone.proposed`` (and the stub devices' default) replay as they did: none accepted
    halves k."""
    d = _started(k=4)
    d.done(1, 101, [])
    assert d.core.state.seqs["r"].spec_k == 2


@pytest.mark.parametrize(("extras", "proposed", "match"), [
    ([], [5], "0 proposals accepted of 5 proposed on a row with 4 proposal slots"),
    ([102, 103], [1], "2 proposals accepted of 1 proposed"),
    ([], [-1], "of -1 proposed"),
])
def test_a_proposed_count_outside_accepted_to_slots_is_an_invariant_violation(extras: list[int],
                                                                               proposed: list[int],
                                                                               match: str) -> None:
    d = _started(k=4)
    with pytest.raises(InvariantViolation, match=match):
        _done_proposed(d, 1, 101, extras, proposed)


def test_proposals_on_a_row_without_slots_are_an_invariant_violation() -> None:
    d = _started(k=0)
    with pytest.raises(InvariantViolation, match="no proposal slots"):
        _done_proposed(d, 1, 101, [], [2])


def test_a_proposed_column_of_the_wrong_length_is_an_invariant_violation() -> None:
    d = _started(k=4)
    with pytest.raises(InvariantViolation, match="length differs"):
        _done_proposed(d, 1, 101, [], [0, 0])


def test_a_sequence_that_stops_accepting_retries_one_slot_after_a_while() -> None:
    d = _started(k=1, max_tokens=100)
    seq = d.core.state.seqs["r"]
    d.done(1, 101, [])
    assert seq.spec_k == 0 and seq.spec_retry == 1 + RETRY_AFTER  # outputs before the row's own
    step = 2
    while len(seq.outputs) < seq.spec_retry:
        assert d.row(step)[1] == 1
        d.done(step, 200 + step)
        step += 1
    assert d.row(step)[1] == 2 and seq.spec_k == 1


def test_at_depth_2_a_retrying_sequence_speculates_on_a_row_fed_from_its_plain_row() -> None:
    d = _started(k=1, depth=2, max_tokens=100)
    seq = d.core.state.seqs["r"]
    d.done(1, 101, [])
    step = 2
    while seq.spec_k == 0:
        d.run()  # plans the next step fed from the one in flight
        d.done(step, 300 + step)
        step += 1
    spec_steps = [s for s in d.steps.values() if "r" in s.request_ids and PROPOSE in s.token_ids]
    assert any(s.fed_from[s.request_ids.index("r")] != NOT_FED for s in spec_steps)


@pytest.mark.parametrize("params", [
    SamplingSpec(max_tokens=50, logprobs=True),
    SamplingSpec(max_tokens=50, thinking_budget=5),
    SamplingSpec(max_tokens=50, structured=Structured(kind="json_object")),
])
def test_requests_whose_tokens_need_more_than_their_logits_do_not_propose(params: SamplingSpec) -> None:
    d = _spec()
    d.run(RequestArrived("r", PROMPT, params, seed=7))
    d.done(0, 100)
    assert d.row(1)[1] == 1


def test_off_by_default() -> None:
    d = Driver(_core())
    d.run(_arrive())
    d.done(0, 100)
    assert d.row(1)[1] == 1 and d.core.state.seqs["r"].spec_k == 0


def test_a_stop_token_among_the_accepted_tokens_finishes_there() -> None:
    d = _started()
    d.done(1, 101, [2, 103])  # EOS (2) is output 2
    assert d.finish is not None and d.finish.reason == "stop" and d.emitted[-1] == (2, 2)


def test_a_failed_step_drops_its_rows_slots() -> None:
    d = _started()
    d.run(StepFailed(1, "boom"))
    assert d.core.state.spec_rows == 0 and d.finish is not None and d.finish.reason == "error"


def test_the_decode_lane_stands_down_with_speculation_on() -> None:
    d = _started(k=2)
    d.done(1, 101, [])
    assert d.core.state.lane is None


def test_rejected_kv_never_enters_the_prefix_cache() -> None:
    """A request that ends right after a row with rejected proposals offers only its verified positions."""
    d = _spec(16, block_size=4, num_blocks=64)
    d.run(_arrive(max_tokens=3))  # output 0, then a row of 1 + 1 slot... max_tokens bounds it
    d.done(0, 100)
    d.done(1, 101, [])  # output 1; the slot's position 21 (output 1's would-be input) holds a rejected proposal
    d.done(2, 102)  # output 2: length
    assert d.finish is not None
    pool = d.core.state.pool
    cached = sum(1 for h in pool.hash_of if h is not None)
    assert cached == (P + 2) // 4  # positions 0..21 have verified KV: 5 full blocks of 4


def test_a_swapped_victim_spills_only_the_blocks_that_hold_its_verified_kv() -> None:
    """Blocks taken for rejected proposal slots stay in the table (the next rows overwrite them), but a spill
    copies only the blocks its settled KV fills: the swap-in brings ``blocks_for(kv_settled)`` blocks back, and a
    host copy of more blocks than that could not be written into them (the default model's run found this)."""
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128, spill_enabled=True, speculative_tokens=16)
    state = core.state
    seq = add_seq(state, "r", 20, outputs=2)
    hold_blocks(state, seq, 3)  # a row at position 21 took blocks through position 37 for its 16 slots
    seq.num_computed = seq.kv_settled = 22  # none accepted: KV through output 0, output 1 pending
    table = list(seq.block_ids)
    ctx = TickContext()
    take_off_device(state, ctx, seq)
    spill = next(c for c in ctx.commands if isinstance(c, SpillOut))
    assert (spill.block_ids, spill.num_tokens) == (table[:2], 22)
    assert len(spill.block_ids) <= blocks_for(seq.spill_tokens, 16), "the swap-in's blocks can take the copy"


def test_the_oracle_device_refuses_a_swap_in_with_fewer_blocks_than_were_spilled() -> None:
    """As ``PagedKVCache.copy_blocks_in`` does, so that the blasts catch a core that spills too many blocks."""
    oracle = OracleExecutor(vocab_size=100)
    oracle.handle([SpillOut("r", [1, 2, 3], 20)])
    with pytest.raises(AssertionError, match="3 blocks were spilled, only 2"):
        oracle.handle([SwapIn("r", [4, 5], 20)])
    oracle.handle([SpillOut("r", [1, 2], 20), SwapIn("r", [4, 5, 6], 20)])  # more room than the copy: fine


def _spec_config(config: object, k: int) -> object:
    return msgspec.structs.replace(config, speculative_tokens=k)  # type: ignore[type-var]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("spill", [False, True])
def test_blast_with_speculation_keeps_every_invariant_and_the_oracle_tokens(depth: int, spill: bool) -> None:
    """Random arrivals, cancels, deadlines, stop matches, failures, preemption and swaps with the oracle accepting
    0 to k proposals: every request ends once with exactly the oracle's tokens (the same as without speculation),
    nothing leaks, and no rejected proposal's KV is read, cached or spilled."""
    config = _spec_config(blast_config(depth, spill, True, 24), 4)
    h = run_blast(9300 + depth * 10 + spill, 500, config)  # type: ignore[arg-type]
    steps = [c for out in h.outputs for c in out.commands if isinstance(c, RunStep)]
    assert sum(s.token_ids.count(PROPOSE) for s in steps) > 100, "the blast made proposal slots"
    assert any(isinstance(i, StepDone) and i.extra_token_ids for tick in h.inputs for i in tick.inputs)


@pytest.mark.parametrize("seed", range(2800, 2806))
def test_random_config_blast_with_speculation(seed: int) -> None:
    run_blast(seed, 300, _spec_config(random_config(seed), 1 + seed % 6), shutdown=seed % 3 == 0)  # type: ignore[arg-type]
