"""Rules at their edges, found by mutation testing (``scripts/mutate.sh``), part two: failures (a failed spill,
a failed step and who shares its blocks), stop matches, inputs the core refuses, thinking with a zero budget,
resuming near ``max_seq_len``, and what one step may hold. Part one is ``test_core_mutants.py``.
"""

from __future__ import annotations

import math

import pytest
from core_harness import Harness, arrival
from core_state import THINK_END, THINK_START, add_seq, commands_of, hold_blocks, make_core, snap_seq, tick

from tickloom.engine.core import CoreConfig, InvariantViolation, SchedulerCore
from tickloom.engine.core.status import Status
from tickloom.events import (
    NO_SAMPLE,
    ClientGone,
    DeadlineReached,
    DropSpill,
    EmitTokens,
    Finish,
    Preempted,
    RequestCancelled,
    RunStep,
    SamplingSpec,
    SpillDone,
    SpillOut,
    StepDone,
    StepFailed,
    StopMatched,
    SwapIn,
    SwapInFailed,
    SwapInReady,
    TickInputs,
    Usage,
    WatchDeadline,
)
from tickloom.replay.oracle import OracleExecutor

# -- C09: a failed spill falls back to requeue ------------------------------------------------------------------


def test_c09_a_failed_spill_falls_back_to_requeue_and_drops_its_spill_once() -> None:
    config = CoreConfig(num_blocks=10, block_size=16, spill_enabled=True, max_batch_size=4, max_seq_len=128,
                        max_prefill_tokens=64)
    h = Harness(config, spill_fails={"r1"})
    h.step(arrival("r0", 20, 60), arrival("r1", 40, 8))
    h.step()
    h.step(arrival("r2", 100, 4))  # C23: admission swaps r1 out
    assert [c.request_id for _, c in h.commands(SpillOut)] == ["r1"]
    out = h.step(SwapInReady("r1"))  # the harness lists SpillDone(r1, failed) first; the readiness is stale
    assert DropSpill("r1") in out.commands
    snap = h.core.snapshot()
    parked = snap_seq(snap, "r1")
    assert parked.status is Status.PREEMPTED and [snap.seqs[i].request_id for i in snap.preempted] == ["r1"]
    assert not parked.has_spill and not parked.swap_ready, "nothing is left in the spill store for it"
    h.run()
    assert [c.request_id for _, c in h.commands(DropSpill)] == ["r1"], "its spill entry is dropped once"
    assert not h.commands(SwapIn), "it comes back by recompute"
    assert h.reason("r1") == "length" and len(h.output("r1")) == 8


# -- E05 / running ahead: a failed step fails its rows, the rows fed from it, and whoever shares its blocks -------


def test_a_failed_step_fails_its_rows_and_those_sharing_the_blocks_it_registered() -> None:
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128, pipeline_depth=2)
    prompt = list(range(100, 140))  # 40 tokens: step 0 registers its 2 full blocks
    tick(core, arrival("r", prompt, 10), arrival("c", 10, 10))
    [step1] = commands_of(tick(core, arrival("q", prompt, 10), arrival("z", 10, 10), RequestCancelled("c")), RunStep)
    assert step1.request_ids == ["r", "q", "z"] and step1.fed_from == [0, -1, -1], "q hits r's 2 blocks"
    assert [(step, rid) for step, rid, _ in core.snapshot().fences] == [(0, "c")]
    out = tick(core, StepFailed(0, "boom"))
    finishes = {c.request_id: c for c in commands_of(out, Finish)}
    assert list(finishes) == ["r", "q"], "r's row failed, and q shares the blocks it registered; z does not"
    assert {f.reason for f in finishes.values()} == {"error"}
    assert {f.error for f in finishes.values()} == {"step 0 failed: boom"}
    snap = core.snapshot()
    assert all(h is None for h in snap.pool.hash_of), "the blocks step 0 registered left the prefix cache"
    assert [(step, rid) for step, rid, _ in snap.fences] == [(1, "r"), (1, "q")], "c's fence went with step 0"
    [z] = [seq for seq in snap.seqs[: snap.live]]
    assert z.request_id == "z" and z.status is Status.RUNNING
    out = tick(core, StepDone(1, ["r", "q", "z"], [7, 8, 9]))
    emitted = [(c.request_ids, c.token_ids) for c in commands_of(out, EmitTokens)]
    assert emitted == [(["z"], [9])], "r and q are discarded"
    assert core.snapshot().fences == []


def test_a_failed_step_fails_the_rows_fed_from_it() -> None:
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128, pipeline_depth=2, prefix_caching=False)
    tick(core, arrival("r", 20, 10))
    [step1] = commands_of(tick(core), RunStep)
    assert step1.request_ids == ["r"] and step1.fed_from == [0], "running ahead: step 1 is fed from step 0"
    out = tick(core, StepFailed(0, "device lost"))
    assert commands_of(out, Finish) == [Finish("r", "error", Usage(20, 0, 0), "step 0 failed: device lost")]
    out = tick(core, StepFailed(1, "device lost"))
    assert not commands_of(out, Finish), "r ended once"
    snap = core.snapshot()
    assert snap.live == 0 and snap.fences == [] and len(snap.pool.free) == 16


def test_c14_a_deadline_due_when_a_step_fails_ends_its_rows_as_timeout() -> None:
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128, pipeline_depth=2)
    prompt = list(range(100, 140))
    tick(core, arrival("r", prompt, 10, deadline_ns=5))
    tick(core, arrival("q", prompt, 10, deadline_ns=5))  # q shares the 2 blocks step 0 registers
    out = core.tick(TickInputs(3, 5, [StepFailed(0, "boom")]))
    reasons = {c.request_id: c.reason for c in commands_of(out, Finish)}
    assert reasons == {"r": "timeout", "q": "timeout"}, "timeout > error at the same token"


# -- C14: a stop match names a delivered token --------------------------------------------------------------------


def _decoding(outputs: int) -> SchedulerCore:
    core = make_core(num_blocks=16, max_seq_len=128)
    hold_blocks(core.state, add_seq(core.state, "r", 20, outputs=outputs), 2)
    return core


def test_c14_a_stop_match_at_the_first_token_truncates_to_it() -> None:
    core = _decoding(3)
    out = tick(core, StopMatched("r", 0))
    [finish] = commands_of(out, Finish)
    assert (finish.reason, finish.usage.completion_tokens) == ("stop", 1)


@pytest.mark.parametrize("index", [-1, 3])
def test_c14_a_stop_match_past_the_delivered_tokens_is_refused(index: int) -> None:
    core = _decoding(3)
    with pytest.raises(InvariantViolation) as raised:
        tick(core, StopMatched("r", index))
    assert str(raised.value) == (
        f"stop matches name delivered tokens: 'r' has 3 outputs; a stop string matched at {index}"
    )


def test_c14_a_stop_match_for_an_unknown_request_is_ignored() -> None:
    core = _decoding(3)
    out = tick(core, StopMatched("gone", 5))
    assert not commands_of(out, Finish)


def test_c14_a_stop_match_then_a_deadline_in_the_same_tick_meet_at_the_truncated_token() -> None:
    # The stop match (applied with the inputs) truncates to index 1; the deadline sweep then times the request out
    # at its last token, now index 1 too, where timeout takes precedence over stop.
    core = _decoding(3)
    seq = core.state.seqs["r"]
    seq.deadline_ns = 0
    core.state.deadlines.append((0, seq.arrival, "r"))
    out = tick(core, StopMatched("r", 1))
    [finish] = commands_of(out, Finish)
    assert (finish.reason, finish.usage.completion_tokens) == ("timeout", 2)


# -- Inputs that contradict what the core knows are refused, naming the rule ------------------------------------


def _refused(core: SchedulerCore, tick_inputs: TickInputs) -> str:
    with pytest.raises(InvariantViolation) as raised:
        core.tick(tick_inputs)
    return str(raised.value)


def _one_step() -> tuple[SchedulerCore, RunStep]:
    core = make_core(num_blocks=16, max_seq_len=128)
    [step] = commands_of(tick(core, arrival("r", 10, 4)), RunStep)
    return core, step


def test_a_result_for_a_step_out_of_order_is_refused() -> None:
    core, step = _one_step()
    message = _refused(core, TickInputs(2, 0, [StepDone(step.step_id + 1, ["r"], [7])]))
    assert message == f"steps settle in order: got a result for step {step.step_id + 1}, expected {step.step_id}"


def test_a_result_with_no_step_in_flight_is_refused() -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    assert _refused(core, TickInputs(1, 0, [StepFailed(0, "x")])) == (
        "steps settle in order: got a result for step 0, expected None"
    )


def test_a_result_for_other_rows_is_refused() -> None:
    core, step = _one_step()
    assert _refused(core, TickInputs(2, 0, [StepDone(step.step_id, ["x"], [7])])) == (
        f"step results match their step: step {step.step_id} sampled for ['r'] but reported ['x']"
    )


def test_a_result_with_a_token_count_unlike_its_rows_is_refused() -> None:
    core, step = _one_step()
    assert _refused(core, TickInputs(2, 0, [StepDone(step.step_id, ["r"], [7, 8])])) == (
        f"step results match their step: step {step.step_id}: 2 tokens for 1 rows"
    )


def test_an_arrival_reusing_a_live_request_id_is_refused() -> None:
    core, _ = _one_step()
    assert _refused(core, TickInputs(2, 0, [arrival("r", 10, 4)])) == (
        "unique request ids: request 'r' arrived while still live"
    )


def test_ticks_are_consecutive_and_time_never_goes_back() -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    core.tick(TickInputs(1, 10, []))
    assert _refused(core, TickInputs(3, 10, [])) == "ticks are consecutive: tick 3 after tick 1"
    assert _refused(core, TickInputs(2, 9, [])) == "time never goes back: now_ns 9 < 10"
    core.tick(TickInputs(2, 10, []))  # the same time again is fine


# -- C20 with a zero budget, stale notices --------------------------------------------------------------------


def test_c20_a_zero_budget_forces_think_end_as_the_first_output() -> None:
    config = CoreConfig(num_blocks=16, max_seq_len=128, think_start_token=THINK_START, think_end_token=THINK_END)
    h = Harness(config, oracle=OracleExecutor(config.vocab_size, avoid=(THINK_START, THINK_END)))
    out = h.step(arrival("r", [*range(100, 110), THINK_START], params=SamplingSpec(max_tokens=4, thinking_budget=0)))
    [emit] = commands_of(out, EmitTokens)
    assert (emit.request_ids, emit.token_ids, emit.token_indices, emit.reasoning) == (["r"], [THINK_END], [0], [True])
    [prefill] = commands_of(out, RunStep)
    assert prefill.sample_indices == [NO_SAMPLE], "the prefill samples nothing: output 0 is known"
    h.run()
    assert h.output("r")[0] == THINK_END and THINK_END not in h.output("r")[1:]
    assert h.finishes["r"].usage.reasoning_tokens == 1 and len(h.output("r")) == 4


def test_c12_a_deadline_notice_for_another_deadline_is_ignored() -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    tick(core, arrival("r", 10, 4, deadline_ns=10**12))
    out = tick(core, DeadlineReached("r", 10**12 - 1))
    assert not commands_of(out, Finish), "a notice for a deadline r does not have"
    [finish] = commands_of(tick(core, DeadlineReached("r", 10**12)), Finish)
    assert finish.reason == "timeout"


def test_c10_swap_in_failed_ends_a_swapped_request_and_is_ignored_after() -> None:
    core = make_core(num_blocks=16, max_seq_len=128, spill_enabled=True)
    swapped = add_seq(core.state, "s", 20, outputs=5, status=Status.SWAPPED)
    swapped.spill_tokens, swapped.has_spill = 24, True
    out = tick(core, SwapInFailed("s", "checksum mismatch"))
    assert commands_of(out, Finish) == [Finish("s", "error", Usage(20, 0, 5), "swap-in failed: checksum mismatch")]
    assert DropSpill("s") in out.commands
    assert not tick(core, SwapInFailed("s", "again")).commands, "a late report for an ended request is ignored"


# -- C08: resuming needs need + 1 blocks, but never more than the sequence can still use ----------------------------


def test_c08_a_requeued_sequence_one_block_from_max_seq_len_resumes_in_the_smallest_pool() -> None:
    # max_seq_len 100 at block size 16: the config needs 100 // 16 + 1 = 7 blocks, and that is the pool. p (less
    # important) is requeued at 97 tokens when it needs its 7th block. Its history (96 tokens) takes 7 blocks and
    # it can never grow past them (99 tokens at most: position 98 is in block 7), so the idle pool fits it once q
    # ends; "need + 1" asks for an 8th block that does not exist.
    h = Harness(CoreConfig(num_blocks=7, block_size=16, max_seq_len=100, max_prefill_tokens=128))
    h.step(arrival("q", 4, 60), arrival("p", 90, 9, priority=1))
    h.run()
    assert [c.request_id for _, c in h.commands(Preempted)] == ["p"]
    assert h.reason("q") == "length"
    assert h.finishes["p"].error == "" and h.reason("p") == "length" and len(h.output("p")) == 9


# -- C04 / C15 / C16: what a step may hold -------------------------------------------------------------------------


def test_c04_steps_fill_but_never_exceed_their_token_budgets() -> None:
    config = CoreConfig(num_blocks=64, block_size=16, max_seq_len=128, max_batch_size=4, max_batch_tokens=6,
                        max_prefill_tokens=4)
    h = Harness(config)
    prompts = {f"r{i}": 5 + 3 * i for i in range(6)}
    h.step(*(arrival(rid, n, 6) for rid, n in prompts.items()))
    h.run()
    totals, prefills = [], []
    for _, step in h.commands(RunStep):
        prefill = sum(n for rid, pos, n in zip(step.request_ids, step.positions, step.num_tokens, strict=True)
                      if pos < prompts[rid])
        decode_rows = [i for i, (rid, pos) in enumerate(zip(step.request_ids, step.positions, strict=True))
                       if pos >= prompts[rid]]
        assert decode_rows == list(range(len(decode_rows))), "decode rows come first"
        assert len(step.request_ids) <= 4
        totals.append(sum(step.num_tokens))
        prefills.append(prefill)
    assert max(totals) == 6 and max(prefills) == 4, "max_batch_tokens and max_prefill_tokens bind, exactly"
    assert all(h.reason(rid) == "length" and len(h.output(rid)) == 6 for rid in prompts)


def test_c16_no_row_runs_past_max_seq_len() -> None:
    # A 29-token prompt with max_seq_len 32 can sample 3 tokens (the third reaches 32 tokens); with two steps in
    # flight no row is run ahead past the ceiling: the KV positions written are 0 .. 30.
    config = CoreConfig(num_blocks=16, block_size=16, max_seq_len=32, pipeline_depth=2)
    h = Harness(config, device_lag=1)
    h.step(arrival("r", 29, 100))
    h.run()
    rows = [(p, n, s) for _, c in h.commands(RunStep) for p, n, s in
            zip(c.positions, c.num_tokens, c.sample_indices, strict=True)]
    assert max(p + n for p, n, _ in rows) == 31 and [s for *_, s in rows] == [0, 1, 2]
    assert h.reason("r") == "length" and len(h.output("r")) == 3


def test_c15_no_row_is_fed_from_a_step_whose_token_may_be_forced() -> None:
    # Thinking with a budget of 2: the row that would sample after the budget is spent is not run ahead, since
    # think-end will be forced as its input.
    config = CoreConfig(num_blocks=16, max_seq_len=128, pipeline_depth=2,
                        think_start_token=THINK_START, think_end_token=THINK_END)
    h = Harness(config, oracle=OracleExecutor(config.vocab_size, avoid=(THINK_START, THINK_END)), device_lag=1)
    h.step(arrival("r", [*range(100, 110), THINK_START], params=SamplingSpec(max_tokens=6, thinking_budget=2)))
    h.run()
    out = h.output("r")
    assert out[2] == THINK_END and THINK_END not in out[:2] and len(out) == 6
    sampled = [s for _, c in h.commands(RunStep) for s in c.sample_indices if s >= 0]
    assert sampled == [0, 1, 3, 4, 5], "index 2 is forced, never sampled, and nothing was run ahead into it"


def test_c14_a_cancel_and_a_stop_match_at_the_same_token_end_as_cancelled() -> None:
    core = _decoding(3)
    out = tick(core, RequestCancelled("r"), StopMatched("r", 2))
    [finish] = commands_of(out, Finish)
    assert (finish.reason, finish.usage.completion_tokens) == ("cancelled", 3), "cancelled > stop at one token"


def test_c17_rows_streamed_beside_a_discarded_row_are_not_reasoning() -> None:
    h = Harness(CoreConfig(num_blocks=16, max_seq_len=128, pipeline_depth=2), device_lag=1)
    h.step(arrival("r", 20, 50), arrival("s", 20, 12))
    for _ in range(4):
        h.step()
    h.step(RequestCancelled("r"))  # r still has rows in both steps in flight: they are discarded as they settle
    h.run()
    assert h.reason("r") == "cancelled" and len(h.tokens["s"]) == 12
    assert not any(any(c.reasoning) for _, c in h.commands(EmitTokens)), "no thinking markers: nothing is reasoning"


def test_inputs_naming_unknown_requests_are_ignored() -> None:
    # The request ended already (its notice raced its finish) or never reached the core: nothing happens.
    core = make_core(num_blocks=16, max_seq_len=128, spill_enabled=True)
    out = tick(core, RequestCancelled("x"), ClientGone("x"), SpillDone("x", False, "e"), SwapInReady("x"),
                SwapInFailed("x", "e"), StopMatched("x", 0), DeadlineReached("x", 5))
    assert out.commands == [] and not out.needs_tick


def test_c12_an_arrival_with_a_deadline_asks_for_a_wake_up() -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    out = tick(core, arrival("r", 10, 4, deadline_ns=5_000), arrival("s", 10, 4))
    assert commands_of(out, WatchDeadline) == [WatchDeadline("r", 5_000)], "only a request with a deadline is watched"


def test_logprobs_stay_aligned_when_two_steps_settle_in_one_tick_and_only_the_first_has_them() -> None:
    core = make_core(num_blocks=16, max_seq_len=128, pipeline_depth=2)
    tick(core, arrival("r", 10, 8))
    [step1] = commands_of(tick(core), RunStep)
    assert step1.fed_from == [0]
    out = tick(core, StepDone(0, ["r"], [7], logprobs=[-0.5]), StepDone(1, ["r"], [8]))
    [emit] = commands_of(out, EmitTokens)
    assert emit.request_ids == ["r", "r"] and emit.token_ids == [7, 8]
    assert emit.logprobs is not None and len(emit.logprobs) == 2
    assert emit.logprobs[0] == -0.5 and math.isnan(emit.logprobs[1]), "no logprob for the second: NaN in its place"


def test_c14_a_deadline_due_when_a_swap_in_fails_ends_it_as_timeout() -> None:
    core = make_core(num_blocks=16, max_seq_len=128, spill_enabled=True)
    swapped = add_seq(core.state, "s", 20, outputs=5, status=Status.SWAPPED)
    swapped.spill_tokens, swapped.has_spill, swapped.deadline_ns = 24, True, 0
    core.state.deadlines.append((0, swapped.arrival, "s"))
    [finish] = commands_of(tick(core, SwapInFailed("s", "checksum mismatch")), Finish)
    assert (finish.reason, finish.usage.completion_tokens) == ("timeout", 5), "timeout > error at the same token"


@pytest.mark.parametrize("thinking", [False, True])
def test_c15_rows_run_ahead_up_to_the_context_ceiling(thinking: bool) -> None:
    # Thinking markers configured: the general plan (not the decode lane) plans every step. A 29-token prompt with
    # max_seq_len 32 samples 3 tokens; with a step always in flight each row after the prefill is fed from the
    # step before it, the last one too: running ahead stops only where a token could be the last. A thinking
    # section without a budget forces nothing, so it runs ahead alike.
    config = CoreConfig(num_blocks=16, block_size=16, max_seq_len=32, pipeline_depth=2,
                        think_start_token=THINK_START, think_end_token=THINK_END)
    h = Harness(config, oracle=OracleExecutor(config.vocab_size, avoid=(THINK_START, THINK_END)), device_lag=1)
    prompt = [*range(100, 128), THINK_START if thinking else 128]
    h.step(arrival("r", prompt, 100))
    h.run()
    steps = [c for _, c in h.commands(RunStep)]
    assert [s.fed_from[0] for s in steps] == [-1, 0, 1] and [s.sample_indices[0] for s in steps] == [0, 1, 2]
    assert h.reason("r") == "length" and h.reasoning["r"] == [thinking] * 3


def test_c04_each_chunk_carries_only_the_blocks_appended_since_the_last() -> None:
    h = Harness(CoreConfig(num_blocks=64, block_size=16, max_seq_len=512, max_prefill_tokens=64))
    h.step(arrival("r", 200, 2))
    h.run()
    steps = [c for _, c in h.commands(RunStep)]
    deltas = [(s.positions[0], s.num_tokens[0], s.block_starts[0], s.num_new_blocks[0]) for s in steps]
    # 64, 64, 64 and 8 tokens: tables of 4, 8, 12 and 13 blocks; then a decode row in block 13, already sent.
    assert deltas == [(0, 64, 0, 4), (64, 64, 4, 4), (128, 64, 8, 4), (192, 8, 12, 1), (200, 1, 13, 0)]
    table = [b for s in steps for b in s.new_block_ids]
    assert len(table) == len(set(table)) == 13


def test_c05_a_sequence_with_a_row_in_the_step_being_planned_is_no_victim() -> None:
    # a and c got their rows (no new block needed); b, last in running order, needs a third block and none is
    # free. a and c are not victims, though they have fewer outputs: b itself is requeued.
    core = make_core(num_blocks=4, block_size=16, max_seq_len=48)
    state = core.state
    hold_blocks(state, add_seq(state, "a", 10, outputs=2), 1)
    hold_blocks(state, add_seq(state, "c", 10, outputs=2), 1)
    hold_blocks(state, add_seq(state, "b", 30, outputs=3), 2)  # pending token at position 32: block 3
    out = tick(core)
    assert commands_of(out, Preempted) == [Preempted("b", "requeue")]
    [step] = commands_of(out, RunStep)
    assert step.request_ids == ["a", "c"]


def test_c04_a_batch_of_exactly_max_batch_tokens_decode_rows_all_decode() -> None:
    # Thinking markers configured (never used): the general plan, not the decode lane, plans every step.
    config = CoreConfig(num_blocks=16, block_size=16, max_seq_len=64, max_batch_size=2, max_batch_tokens=2,
                        max_prefill_tokens=2, think_start_token=THINK_START, think_end_token=THINK_END)
    h = Harness(config, oracle=OracleExecutor(config.vocab_size, avoid=(THINK_START, THINK_END)))
    h.step(arrival("a", 4, 20), arrival("b", 4, 5))
    h.run()
    both = [c for _, c in h.commands(RunStep) if c.request_ids == ["a", "b"] and c.sample_indices[1] >= 1]
    assert len(both) == 4, "once b decodes, both rows fit the budget of 2 tokens in every step"
    finished = [c.request_id for _, c in h.commands(Finish)]
    assert finished == ["b", "a"] and h.reason("a") == h.reason("b") == "length"


def test_c05_rows_after_a_victim_in_running_order_still_run() -> None:
    # a needs a third block and none is free: b (fewest outputs) is requeued; c, after b, still gets its row.
    core = make_core(num_blocks=4, block_size=16, max_seq_len=48)
    state = core.state
    hold_blocks(state, add_seq(state, "a", 30, outputs=3), 2)  # pending token at position 32: block 3
    hold_blocks(state, add_seq(state, "b", 10, outputs=1), 1)
    hold_blocks(state, add_seq(state, "c", 10, outputs=2), 1)
    out = tick(core)
    assert commands_of(out, Preempted) == [Preempted("b", "requeue")]
    [step] = commands_of(out, RunStep)
    assert step.request_ids == ["a", "c"]


@pytest.mark.parametrize("depth", [1, 2])
def test_c15_a_planned_step_asks_for_a_tick_only_while_the_pipeline_has_room(depth: int) -> None:
    core = make_core(num_blocks=16, max_seq_len=128, pipeline_depth=depth)
    out = tick(core, arrival("r", 10, 8))
    assert commands_of(out, RunStep) and out.needs_tick is (depth == 2), "at depth 2 the next step is fed from this one"
    out = tick(core)
    assert out.needs_tick is False, "the pipeline is full (or, at depth 1, waits for the step)"
