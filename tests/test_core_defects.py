"""Regression tests for five defects of the core, each driven through ``TickInputs``.

1. A watermark reservation larger than the sequence can ever use stalled the head of the queue for good.
2. The deadline heap and ``stop_tokens`` kept entries for finished requests (memory and snapshots grew).
3. A request already past its deadline was admitted and prefilled in the tick that timed it out.
4. ``thinking_budget=0`` let one thinking token through (budgets 0 and 1 gave identical outputs).
5. Mass cancel, time-out, shutdown and priority arrival on a long waiting queue were quadratic.
"""

from __future__ import annotations

import heapq

from core_harness import Harness, arrival
from core_state import add_seq, make_core

from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.engine.core.deadlines import DEADLINE_SLACK, compact_deadlines
from tickloom.engine.core.status import Status
from tickloom.events import (
    BindRequest,
    Command,
    DeadlineReached,
    Finish,
    Input,
    RequestArrived,
    RequestCancelled,
    RunStep,
    SamplingSpec,
    Shutdown,
    TickInputs,
)
from tickloom.replay.oracle import OracleExecutor

# -- 1. the watermark must not stall the head for good --------------------------------------------------------


def test_watermark_reservation_is_clamped_to_max_seq_len() -> None:
    # r1 would reserve blocks(100 + 64) = 11 > 10 blocks, but it can never hold more than max_seq_len = 128
    # tokens: blocks(128) = 9 fit. Before the fix it waited forever (needs_tick False) and r2 starved behind it.
    config = CoreConfig(num_blocks=10, block_size=16, max_seq_len=128, admit_watermark=64)
    h = Harness(config)
    h.step(arrival("r1", 100, 1000), arrival("r2", 20, 8))
    binds = [c.request_id for _, c in h.commands(BindRequest)]
    assert binds and binds[0] == "r1", "r1 is admitted at once"
    h.run()
    assert h.reason("r1") == "length" and len(h.output("r1")) == 28, "r1 runs to max_seq_len"
    assert h.reason("r2") == "length" and len(h.output("r2")) == 8, "r2 is served after it"
    assert not h.core.state.seqs


def test_watermark_still_reserves_room_when_it_fits() -> None:
    # C03's rule is kept below max_seq_len: r2 reserves blocks(40 + 64) = 7 beside r1's 4 and must wait.
    config = CoreConfig(num_blocks=10, block_size=16, max_seq_len=128, admit_watermark=64)
    h = Harness(config)
    h.step(arrival("r1", 40, 8), arrival("r2", 40, 100))
    assert [c.request_id for _, c in h.commands(BindRequest)] == ["r1"]
    h.run()
    assert h.reason("r1") == h.reason("r2") == "length"


def test_lone_request_is_admitted_when_nothing_runs() -> None:
    # Nothing runs; a preempted sequence promises 4 blocks (blocks(32) + 1), so 6 of 10 are left. The head's
    # watermark reservation blocks(40 + 64) = 7 does not fit, but alone it needs only its prompt: blocks(40) = 3.
    core = make_core(num_blocks=10, block_size=16, max_seq_len=128, admit_watermark=64)
    add_seq(core.state, "parked", 30, outputs=3, status=Status.PREEMPTED)
    out = core.tick(TickInputs(1, 0, [arrival("head", 40, 100)]))
    assert [c.request_id for c in out.commands if isinstance(c, BindRequest)] == ["head"]
    assert core.state.seqs["head"].status is Status.RUNNING
    assert core.state.seqs["parked"].status is Status.RUNNING, "the parked sequence resumes beside it"


# -- 2. deadline bookkeeping is bounded by live requests ------------------------------------------------------


def _drive(core: SchedulerCore, oracle: OracleExecutor, tick: int, now_ns: int, inputs: list[Input],
           pending: list[Input]) -> list[Command]:
    out = core.tick(TickInputs(tick, now_ns, [*pending, *inputs]))
    pending[:] = oracle.handle(out.commands)
    return out.commands


def test_finished_requests_leave_the_deadline_heap_stop_tokens_and_snapshots() -> None:
    hour = 3600 * 10**9
    config = CoreConfig(num_blocks=512, block_size=16, max_seq_len=64, max_batch_size=256, max_waiting=20_000,
                        max_prefill_tokens=4096, max_batch_tokens=8192, vocab_size=32000)
    core = SchedulerCore(config)
    oracle = OracleExecutor(config.vocab_size)
    pending: list[Input] = []
    finished = 0
    reasons: set[str] = set()
    tick = 0
    total = 10_000
    snapshot_sizes: list[tuple[int, int]] = []
    while finished < total:
        now_ns = tick * 1_000_000
        arrivals: list[Input] = [
            RequestArrived(f"r{i}", [100 + i % 50, 7, 9], SamplingSpec(max_tokens=2, stop_token_ids=[20_000 + i]),
                           seed=i, deadline_ns=now_ns + hour)
            for i in range(tick * 250, min(total, (tick + 1) * 250))
        ]
        commands = _drive(core, oracle, tick, now_ns, arrivals, pending)
        finishes = [c for c in commands if isinstance(c, Finish)]
        finished += len(finishes)
        reasons.update(c.reason for c in finishes)
        state = core.state
        live = len(state.seqs)
        assert len(state.deadlines) <= 2 * live + 64, f"tick {tick}: {len(state.deadlines)} entries, {live} live"
        assert len(state.stop_tokens) <= live + 1, f"tick {tick}: {len(state.stop_tokens)} stop tokens"
        if tick % 7 == 3:
            snap = core.snapshot()
            snapshot_sizes.append((len(snap.deadlines), live))
            assert len(snap.deadlines) <= live
            assert {rid for _, _, rid in snap.deadlines} <= set(state.seqs)
        tick += 1
        assert tick < 1000
    assert reasons <= {"length", "stop"}  # a request may sample its own stop id
    assert not core.state.seqs
    assert len(core.state.deadlines) <= 64 and not core.snapshot().deadlines
    assert not core.state.stop_tokens
    assert snapshot_sizes



def test_deadline_compaction_waits_until_dead_entries_outnumber_twice_the_live_ones_plus_the_slack() -> None:
    """The rebuild is amortised: a heap of exactly 2 x live + DEADLINE_SLACK entries is left alone (popping skips
    the dead ones), and one entry more rebuilds it down to the live requests' entries."""
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128)
    state = core.state
    live = [add_seq(state, f"live{i}", 4, status=Status.WAITING) for i in range(2)]
    for seq in live:
        state.waiting.append(seq)
        state.deadlines.append((10**12, seq.arrival, seq.request_id))
    limit = 2 * len(live) + DEADLINE_SLACK
    state.deadlines += [(10**12 + i, 10_000 + i, f"gone{i}") for i in range(limit - len(live))]
    heapq.heapify(state.deadlines)
    compact_deadlines(state)
    assert len(state.deadlines) == limit, "at the limit: not rebuilt"
    heapq.heappush(state.deadlines, (10**13, 99_999, "gone-last"))
    compact_deadlines(state)
    assert state.deadlines == sorted((10**12, seq.arrival, seq.request_id) for seq in live)

def test_deadlines_still_fire_after_compaction() -> None:
    # Many short-lived requests with far deadlines, then one whose deadline passes: it still times out.
    config = CoreConfig(num_blocks=256, block_size=16, max_seq_len=64, max_batch_size=128, max_waiting=5000)
    core = SchedulerCore(config)
    oracle = OracleExecutor(config.vocab_size)
    pending: list[Input] = []
    tick = 0
    for batch in range(10):
        arrivals: list[Input] = [
            RequestArrived(f"s{batch}-{i}", [5, 6, 7], SamplingSpec(max_tokens=1), seed=i, deadline_ns=10**15)
            for i in range(100)
        ]
        _drive(core, oracle, tick, tick, arrivals, pending)
        tick += 1
    _drive(core, oracle, tick, tick, [RequestArrived("late", [5, 6, 7], SamplingSpec(max_tokens=50), seed=1,
                                                     deadline_ns=tick + 5)], pending)
    tick += 1
    reasons: dict[str, str] = {}
    for _ in range(20):
        for c in _drive(core, oracle, tick, tick, [], pending):
            if isinstance(c, Finish):
                reasons[c.request_id] = c.reason
        tick += 1
    assert reasons.get("late") == "timeout"
    restored = SchedulerCore.from_snapshot(core.snapshot())
    assert restored.state.deadlines == sorted(restored.state.deadlines)


# -- 3. a request past its deadline is never planned -----------------------------------------------------------


def _rows(h: Harness, tick: int) -> list[str]:
    return [rid for t, c in h.commands(RunStep) if t == tick and isinstance(c, RunStep) for rid in c.request_ids]


def test_expired_waiting_request_is_not_admitted_nor_holds_back_the_head() -> None:
    h = Harness(CoreConfig(num_blocks=10, block_size=16, max_seq_len=128))
    h.now_ns = 5_000_000
    out = h.step(arrival("late", 100, 8, deadline_ns=4_000_000), arrival("live", 100, 8))
    finishes = [(c.request_id, c.reason) for c in out.commands if isinstance(c, Finish)]
    assert finishes == [("late", "timeout")]
    assert [c.request_id for c in out.commands if isinstance(c, BindRequest)] == ["live"], (
        "the expired request takes no blocks; the live one behind it is admitted in the same tick"
    )
    assert _rows(h, 0) == ["live"], "no prefill row is wasted on the expired request"
    assert h.core.snapshot().deadlines == []
    h.run()
    assert h.reason("live") == "length"


def test_running_request_past_its_deadline_gets_no_row() -> None:
    h = Harness(CoreConfig(num_blocks=16, block_size=16, max_seq_len=128))
    h.step(arrival("r", 20, 50, deadline_ns=3_500_000), arrival("other", 20, 10))
    h.run()
    tick = next(t for t, c in h.commands(Finish) if c.request_id == "r")
    assert h.reason("r") == "timeout" and h.inputs[tick].now_ns >= 3_500_000
    assert "r" not in _rows(h, tick), "no row is planned for a request already past its deadline"
    assert "other" in _rows(h, tick)
    assert h.reason("other") == "length"


def test_deadline_notice_also_stops_planning() -> None:
    h = Harness(CoreConfig(num_blocks=16, block_size=16, max_seq_len=128))
    h.step(arrival("r", 20, 50, deadline_ns=10**12))
    h.step()
    out = h.step(DeadlineReached("r", 10**12))
    assert [(c.request_id, c.reason) for c in out.commands if isinstance(c, Finish)] == [("r", "timeout")]
    assert not any(isinstance(c, RunStep) and "r" in c.request_ids for c in out.commands)


# -- 4. thinking budget 0 ---------------------------------------------------------------------------------------

THINK, END = 5, 6


def _thinking(budget: int | None, depth: int = 1, prompt_thinks: bool = True,
              script: dict[int, int] | None = None, lag: int = 0) -> Harness:
    config = CoreConfig(num_blocks=32, block_size=16, max_seq_len=64, think_start_token=THINK,
                        think_end_token=END, pipeline_depth=depth)
    h = Harness(config, steps_per_tick=depth, device_lag=lag)
    prompt = [*range(100, 113), *([THINK] if prompt_thinks else [])]
    if script:
        h.oracle.scripted["a"] = script
    h.step(arrival("a", prompt, params=SamplingSpec(max_tokens=12, thinking_budget=budget), seed=3))
    h.run()
    return h


def _thinking_tokens(h: Harness, prompt_thinks: bool = True) -> int:
    thinking, count = prompt_thinks, 0
    for token in h.output("a"):
        if token == THINK:
            thinking = True
        elif token == END:
            thinking = False
        elif thinking:
            count += 1
    return count


def test_thinking_budget_zero_allows_no_thinking_token() -> None:
    for depth in (1, 2):
        zero, one = _thinking(0, depth), _thinking(1, depth)
        assert zero.output("a")[0] == END, "the first output is the forced think-end"
        assert _thinking_tokens(zero) == 0 and _thinking_tokens(one) == 1
        assert zero.output("a") != one.output("a")
        assert zero.reasoning["a"] == [True] + [False] * 11, "think-end is marked as reasoning, as in C20"
        assert zero.finishes["a"].usage.reasoning_tokens == 1 and len(zero.output("a")) == 12
        rows = [(c.token_ids[c.request_ids.index("a")], c.sample_indices[c.request_ids.index("a")])
                for _, c in zero.commands(RunStep) if "a" in c.request_ids]
        assert (END, 1) in rows, "think-end is fed as the next input; output 1 is sampled after it"
        assert all(index != 0 for _, index in rows), "output 0 is never sampled"


def test_thinking_budget_zero_after_a_sampled_think_start() -> None:
    # At depth 2 with the device a tick behind, output 3's row is run ahead before think-start (output 2) is
    # known: the budget then forces that row's output to think-end (it used to fail the step-result check).
    outputs = []
    for depth, lag in ((1, 0), (2, 0), (2, 1)):
        h = _thinking(0, depth, prompt_thinks=False, script={2: THINK}, lag=lag)
        out = h.output("a")
        assert out[2] == THINK and out[3] == END, (depth, lag)
        assert _thinking_tokens(h, prompt_thinks=False) == 0
        assert h.reasoning["a"][2:5] == [True, True, False]
        outputs.append(out)
    assert outputs[0] == outputs[1] == outputs[2], "the output does not depend on running ahead"


def test_spent_budget_and_a_second_thinking_section_run_ahead() -> None:
    # Budget 2 spent in a first section; a second think-start sampled while the next row is run ahead.
    outputs = []
    for depth, lag in ((1, 0), (2, 1)):
        h = _thinking(2, depth, prompt_thinks=False, script={1: THINK, 6: THINK}, lag=lag)
        out = h.output("a")
        assert out[1] == THINK and out[4] == END and out[6] == THINK and out[7] == END, (depth, lag)
        assert _thinking_tokens(h, prompt_thinks=False) == 2
        outputs.append(out)
    assert outputs[0] == outputs[1]


def test_thinking_budget_zero_with_max_tokens_one() -> None:
    config = CoreConfig(num_blocks=32, block_size=16, max_seq_len=64, think_start_token=THINK, think_end_token=END)
    h = Harness(config)
    h.step(arrival("a", [100, 101, THINK], params=SamplingSpec(max_tokens=1, thinking_budget=0)))
    h.run()
    assert h.output("a") == [END] and h.reason("a") == "length"
    assert not h.core.state.seqs


# -- 5. long waiting queues are linear -------------------------------------------------------------------------


def _waiting_core(waiting: int, *, priorities: bool = False, deadline_ns: int | None = None) -> SchedulerCore:
    """A core whose one batch slot is taken, with ``waiting`` requests queued behind it."""
    config = CoreConfig(num_blocks=64, block_size=16, max_seq_len=512, max_batch_size=1, max_waiting=waiting + 1)
    core = SchedulerCore(config)
    core.tick(TickInputs(0, 0, [RequestArrived("hold", [1] * 10, SamplingSpec(max_tokens=400), seed=1)]))
    core.tick(TickInputs(1, 1, [
        RequestArrived(f"w{i}", [2] * 10, SamplingSpec(max_tokens=4), seed=i,
                       priority=waiting - i if priorities else 0, deadline_ns=deadline_ns)
        for i in range(waiting)
    ]))
    assert len(core.state.waiting) == waiting
    return core


# How the cost grows with the queue is a speed goal, so it is measured, not asserted: `tickloom bench core --cases
# cancel` times W = 1,000 and 10,000 side by side (the quadratic paths cost 55-75x for 10x the requests; now about
# 11-14x). These tests pin what the linear paths must still get right at scale.


def test_a_mass_cancel_of_a_long_waiting_queue_ends_each_request_once() -> None:
    n = 5000
    core = _waiting_core(n)
    out = core.tick(TickInputs(2, 2, [RequestCancelled(f"w{i}") for i in reversed(range(n))]))
    ended = [c.request_id for c in out.commands if isinstance(c, Finish)]
    assert sorted(ended) == sorted(f"w{i}" for i in range(n)) and len(set(ended)) == n
    assert all(c.reason == "cancelled" for c in out.commands if isinstance(c, Finish))
    assert len(core.state.waiting) == 0 and [s.request_id for s in core.state.running] == ["hold"]
    core.check_invariants()


def test_a_mass_time_out_and_a_shutdown_of_a_long_waiting_queue() -> None:
    n = 3000
    core = _waiting_core(n, priorities=True, deadline_ns=100)
    out = core.tick(TickInputs(2, 200, []))
    assert sorted(c.request_id for c in out.commands if isinstance(c, Finish) and c.reason == "timeout") == sorted(
        f"w{i}" for i in range(n))
    core = _waiting_core(n, priorities=True)
    out = core.tick(TickInputs(2, 2, [Shutdown()]))
    assert len({c.request_id for c in out.commands if isinstance(c, Finish)}) == n + 1, "every request ends once"
    assert not core.state.seqs


def test_priority_arrivals_inserted_at_the_head_keep_their_order() -> None:
    n = 3000
    core = _waiting_core(n, priorities=True)  # each arrival more important than the last
    assert [s.request_id for s in core.state.waiting][:3] == [f"w{n - 1}", f"w{n - 2}", f"w{n - 3}"]
    assert [s.request_id for s in core.state.waiting][-1] == "w0"


def test_waiting_queue_keeps_fcfs_by_priority_and_arrival_through_removals() -> None:
    config = CoreConfig(num_blocks=64, block_size=16, max_seq_len=256, max_batch_size=1, max_waiting=500)
    core = SchedulerCore(config)
    oracle = OracleExecutor(config.vocab_size)
    first = core.tick(TickInputs(0, 0, [RequestArrived("hold", [1] * 10, SamplingSpec(max_tokens=3), seed=1)]))
    arrivals: list[Input] = [
        RequestArrived(f"w{i}", [2] * 10, SamplingSpec(max_tokens=1), seed=i, priority=(i * 7) % 5,
                       deadline_ns=25 if i % 11 == 0 else None)
        for i in range(200)
    ]
    pending: list[Input] = oracle.handle(first.commands)
    pending = oracle.handle(core.tick(TickInputs(1, 1, [*pending, *arrivals])).commands)
    cancelled = {f"w{i}" for i in range(0, 200, 3)}
    cancels: list[Input] = [RequestCancelled(r) for r in sorted(cancelled)]
    pending = oracle.handle(core.tick(TickInputs(2, 2, [*pending, *cancels])).commands)
    expected = sorted(
        (a for a in arrivals if isinstance(a, RequestArrived) and a.request_id not in cancelled),
        key=lambda a: (a.priority, int(a.request_id[1:])),
    )
    assert [s.request_id for s in core.state.waiting] == [a.request_id for a in expected]
    binds: list[str] = []
    timed_out: list[str] = []
    for tick in range(3, 2000):
        out = core.tick(TickInputs(tick, tick * 10, pending))
        core.check_invariants()
        pending = oracle.handle(out.commands)
        binds += [c.request_id for c in out.commands if isinstance(c, BindRequest)]
        timed_out += [c.request_id for c in out.commands if isinstance(c, Finish) and c.reason == "timeout"]
        if not core.state.seqs:
            break
    late = {a.request_id for a in expected if a.deadline_ns is not None}
    assert set(timed_out) == late
    assert binds == [a.request_id for a in expected if a.request_id not in late]
