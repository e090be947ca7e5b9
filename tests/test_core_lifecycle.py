"""C11–C17: no stranding, deadlines, cancellation, finish reasons, running ahead."""

from __future__ import annotations

import pytest
from core_harness import Harness, arrival
from core_state import add_seq, hold_blocks, make_core

from tickloom.engine.core import CoreConfig
from tickloom.engine.core.status import Status
from tickloom.events import (
    BindRequest,
    DeadlineReached,
    DropSpill,
    Finish,
    RequestCancelled,
    RunStep,
    SamplingSpec,
    SpillOut,
    SwapIn,
    SwapInFailed,
    TickInputs,
    UnwatchDeadline,
    WatchDeadline,
)
from tickloom.events.inputs import StopMatched
from tickloom.replay.oracle import OracleExecutor

EOS = 2


def test_c11_parked_sequences_resume_on_idle_ticks() -> None:
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128)
    state = core.state
    parked = add_seq(state, "parked", 20, outputs=3, status=Status.PREEMPTED)
    swapped = add_seq(state, "swapped", 20, outputs=3, status=Status.SWAPPED)
    swapped.spill_tokens, swapped.swap_ready, swapped.has_spill = 22, True, True
    out = core.tick(TickInputs(1, 0, []))
    assert [c.request_id for c in out.commands if isinstance(c, SwapIn)] == ["swapped"]
    assert parked.status is Status.RUNNING and swapped.status is Status.RUNNING
    assert out.needs_tick, "nothing is in flight: the core asks for the tick that plans them"
    step = next(c for c in core.tick(TickInputs(2, 0, [])).commands if isinstance(c, RunStep))
    assert set(step.request_ids) == {"parked", "swapped"}


def test_c11_idle_core_does_not_spin() -> None:
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128)
    assert not core.tick(TickInputs(1, 0, [])).needs_tick


def test_c12_deadline_during_decode_times_out_with_tokens_delivered() -> None:
    h = Harness(CoreConfig(num_blocks=16, block_size=16, max_seq_len=128))
    out = h.step(arrival("r", 20, 50, deadline_ns=5_500_000))
    assert WatchDeadline("r", 5_500_000) in out.commands
    h.run()
    finish = h.finishes["r"]
    assert finish.reason == "timeout"
    tick = next(t for t, c in h.commands(Finish) if c.request_id == "r")
    assert h.inputs[tick].now_ns >= 5_500_000 > h.inputs[tick - 1].now_ns, "timed out in the first tick past it"
    assert finish.usage.completion_tokens == len(h.tokens["r"]) > 0, "the tokens so far were delivered"
    assert UnwatchDeadline("r") in h.outputs[tick].commands
    pool = h.core.state.pool
    assert pool.num_free + pool.num_cached == pool.num_blocks


def test_c12_blocks_fenced_until_the_in_flight_step_settles() -> None:
    # The device lags a tick, so r's step planned at tick 2 is still in flight when r times out at tick 3. (An
    # expired request is never planned, so the step must be one planned before the deadline passed.)
    h = Harness(CoreConfig(num_blocks=16, block_size=16, max_seq_len=128), device_lag=1)
    h.step(arrival("r", 20, 50, deadline_ns=2_500_000))
    for _ in range(2):
        h.step()
    out = h.step()  # now 3 ms: the step planned at tick 2 references r's blocks, then r timed out
    assert any(isinstance(c, Finish) and c.reason == "timeout" for c in out.commands)
    assert not any(isinstance(c, RunStep) for c in out.commands)
    state = h.core.state
    assert state.fences and state.fences[0][1] == "r", "the step just planned still references r's blocks"
    h.step()
    assert not state.fences and state.pool.num_free + state.pool.num_cached == 16


def test_c12_deadline_reached_input_times_out_at_once() -> None:
    h = Harness(CoreConfig(num_blocks=16, block_size=16, max_seq_len=128))
    h.step(arrival("r", 20, 50, deadline_ns=10**12))
    h.step()
    out = h.step(DeadlineReached("r", 10**12))
    assert [(c.request_id, c.reason) for c in out.commands if isinstance(c, Finish)] == [("r", "timeout")]


def test_c12_waiting_preempted_and_swapped_requests_time_out() -> None:
    core = make_core(num_blocks=10, block_size=16, max_seq_len=128, spill_enabled=True)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 100, outputs=1), 10)
    waiting = add_seq(state, "waiting", 30, status=Status.WAITING)
    state.waiting.append(waiting)
    preempted = add_seq(state, "preempted", 30, outputs=2, status=Status.PREEMPTED)
    swapped = add_seq(state, "swapped", 30, outputs=2, status=Status.SWAPPED)
    swapped.has_spill = True
    for i, seq in enumerate((waiting, preempted, swapped)):
        seq.deadline_ns = 100 + i
        state.deadlines.append((seq.deadline_ns, seq.arrival, seq.request_id))
    out = core.tick(TickInputs(1, 1_000, []))
    finishes = {c.request_id: c.reason for c in out.commands if isinstance(c, Finish)}
    assert finishes == {"waiting": "timeout", "preempted": "timeout", "swapped": "timeout"}
    assert DropSpill("swapped") in out.commands, "its spill entry is removed"
    assert set(state.seqs) == {"holder"}


def test_c13_cancel_after_five_tokens() -> None:
    h = Harness(CoreConfig(num_blocks=16, block_size=16, max_seq_len=128))
    h.step(arrival("r", 20, 50))
    while len(h.tokens["r"]) < 5:
        h.step()
    h.step(RequestCancelled("r"))
    h.run()
    assert h.reason("r") == "cancelled"
    assert len(h.tokens["r"]) == 5 and h.finishes["r"].usage.completion_tokens == 5


def _eos_oracle(config: CoreConfig, script: dict[str, dict[int, int]]) -> OracleExecutor:
    return OracleExecutor(config.vocab_size, avoid=config.eos_token_ids, scripted=script)


@pytest.mark.parametrize("eos", [2, 3, 9])
def test_c14_every_eos_id_stops(eos: int) -> None:
    config = CoreConfig(num_blocks=16, max_seq_len=128, eos_token_ids=(2, 3, 9))
    h = Harness(config, oracle=_eos_oracle(config, {"r": {4: eos}}))
    h.step(arrival("r", 20, 50))
    h.run()
    assert h.reason("r") == "stop" and h.output("r")[-1] == eos and len(h.output("r")) == 5


def test_c14_stop_token_ids_and_min_tokens() -> None:
    config = CoreConfig(num_blocks=16, max_seq_len=128, eos_token_ids=(EOS,))
    h = Harness(config, oracle=_eos_oracle(config, {"r": {1: EOS, 3: 77}}))
    params = SamplingSpec(max_tokens=50, min_tokens=3, stop_token_ids=[77])
    out = h.step(arrival("r", 20, params=params))
    bind = next(c for c in out.commands if isinstance(c, BindRequest))
    assert bind.masked_token_ids == [EOS, 77], "the executor masks them until min_tokens"
    h.run()
    assert h.reason("r") == "stop" and len(h.output("r")) == 4, "EOS below min_tokens does not stop; 77 does"


def test_c14_length_by_max_seq_len_and_stop_beats_length() -> None:
    config = CoreConfig(num_blocks=16, max_seq_len=128, eos_token_ids=(EOS,))
    h = Harness(config, oracle=_eos_oracle(config, {"eos_last": {4: EOS}}))
    h.step(arrival("ceiling", 120, 100), arrival("eos_last", 20, 5))
    h.run()
    assert h.reason("ceiling") == "length" and len(h.output("ceiling")) == 8
    assert h.reason("eos_last") == "stop", "EOS at the last allowed token: stop > length"


def test_c14_precedence_at_the_same_token() -> None:
    config = CoreConfig(num_blocks=16, max_seq_len=128, eos_token_ids=(EOS,))
    h = Harness(config, oracle=_eos_oracle(config, {}))
    h.step(arrival("t", 20, 50, deadline_ns=2_000_000), arrival("c", 20, 50), arrival("e", 20, 3))
    h.step()
    h.step(RequestCancelled("t"), RequestCancelled("c"))  # now = deadline of t: timeout > cancelled
    assert h.reason("t") == "timeout" and h.reason("c") == "cancelled"
    while "e" not in h.finishes:
        out = h.step()
        if any(isinstance(c, Finish) for c in out.commands):
            break
        if len(h.tokens["e"]) == 2:  # the next token is its last: length at index 2; an error at index 2 loses
            h.pending.append(SwapInFailed("e", "late report"))
    h.run()
    assert h.reason("e") == "length"


def test_c14_stop_matched_truncates_a_running_request_and_is_ignored_after() -> None:
    h = Harness(CoreConfig(num_blocks=16, max_seq_len=128))
    h.step(arrival("r", 20, 50))
    while len(h.tokens["r"]) < 6:
        h.step()
    out = h.step(StopMatched("r", 3))
    finish = next(c for c in out.commands if isinstance(c, Finish))
    assert finish.reason == "stop" and finish.usage.completion_tokens == 4
    out = h.step(StopMatched("r", 5))
    assert not [c for c in out.commands if isinstance(c, Finish)], "a finished request ignores the report"


def _fenced_blocks(h: Harness, request_id: str) -> list[int]:
    return [b for _, rid, blocks in h.core.state.fences if rid == request_id for b in blocks]


def test_c15_over_run_row_discarded_and_fenced() -> None:
    config = CoreConfig(num_blocks=16, max_seq_len=128, eos_token_ids=(EOS,), pipeline_depth=2)
    h = Harness(config, oracle=_eos_oracle(config, {"r": {3: EOS}}), device_lag=1)
    h.step(arrival("r", 20, 50), arrival("s", 20, 10))
    while "r" not in h.finishes:
        h.step()
    steps = [c for _, c in h.commands(RunStep) if "r" in c.request_ids]
    assert [s.sample_indices[s.request_ids.index("r")] for s in steps] == [0, 1, 2, 3, 4], "one step ran ahead"
    assert steps[-1].fed_from[steps[-1].request_ids.index("r")] == steps[-2].step_id
    assert h.finishes["r"].usage.completion_tokens == 4 and h.output("r")[-1] == EOS
    fenced = _fenced_blocks(h, "r")
    assert fenced, "the over-run row's step is in flight: r's blocks are fenced"
    state = h.core.state
    assert not set(fenced) & (set(state.pool.free) | set(state.pool.cached))
    h.step()
    assert not _fenced_blocks(h, "r"), "released once that step settles"
    h.run()
    assert len(h.tokens["r"]) == 4, "the over-run token was never streamed"


def _workload(depth: int, lag: int) -> Harness:
    config = CoreConfig(num_blocks=12, block_size=16, max_seq_len=96, eos_token_ids=(EOS,), pipeline_depth=depth,
                        max_prefill_tokens=48)
    script = {"a": {5: EOS}, "b": {0: EOS}, "d": {17: EOS}}
    h = Harness(config, oracle=_eos_oracle(config, script), device_lag=lag)
    h.step(arrival("a", 30, 20), arrival("b", 15, 5), arrival("c", 40, 30))
    h.step(arrival("d", 50, 30), arrival("e", 10, 1, params=SamplingSpec(max_tokens=2, stop_token_ids=[])))
    h.run()
    return h


def test_c15_client_output_identical_to_depth_one() -> None:
    one, two = _workload(1, 0), _workload(2, 1)
    assert any(c.fed_from != [-1] * len(c.fed_from) for _, c in two.commands(RunStep)), "depth 2 ran ahead"
    for rid in "abcde":
        assert (two.output(rid), two.reason(rid)) == (one.output(rid), one.reason(rid)), rid
        assert two.tokens[rid] == one.tokens[rid]


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_c16_no_over_run_past_a_known_end(max_tokens: int) -> None:
    config = CoreConfig(num_blocks=16, max_seq_len=128, pipeline_depth=2, max_prefill_tokens=16)
    h = Harness(config, device_lag=1)
    h.step(arrival("r", 40, max_tokens))
    h.run()
    assert h.oracle.written["r"] == list(range(40 + max_tokens - 1)), "the last sampled token is never fed back"
    assert len(h.output("r")) == max_tokens and h.reason("r") == "length"


def test_c17_exactly_once_delivery_under_cancellation() -> None:
    config = CoreConfig(num_blocks=64, max_seq_len=128, pipeline_depth=2)
    h = Harness(config, device_lag=1)
    ids = [f"r{i}" for i in range(10)]
    h.step(*(arrival(rid, 10 + i, 60) for i, rid in enumerate(ids)))
    for _ in range(4):
        h.step()
    in_flight = len(h.core.state.steps)
    assert in_flight == 2
    for rid in [ids[i] for i in (3, 0, 7, 1, 9, 5, 2, 8, 4, 6)]:
        before = len(h.tokens[rid])
        h.step(RequestCancelled(rid))
        assert h.reason(rid) == "cancelled" and len(h.tokens[rid]) == before
        assert h.finishes[rid].usage.completion_tokens == before
    h.run()
    assert all(len(h.tokens[rid]) == h.finishes[rid].usage.completion_tokens for rid in ids)
    assert not h.commands(SpillOut)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_c14_the_stop_rule_names_eos_only_when_it_may_stop_the_request(ignore_eos: bool) -> None:
    """``stop_rule`` feeds the bulk commit's filter (``state.stop_tokens``): EOS is in it unless ignored, and the
    length limit is ``max_tokens`` or what ``max_seq_len`` leaves after the prompt, whichever is smaller."""
    from tickloom.engine.core.finish import stop_rule
    from tickloom.events import SamplingSpec

    core = make_core(num_blocks=16, block_size=16, max_seq_len=64, eos_token_ids=[1, 3])
    seq = add_seq(core.state, "r", 20)
    seq.params = SamplingSpec(max_tokens=100, stop_token_ids=[9], ignore_eos=ignore_eos)
    tokens, limit = stop_rule(core.state.config, seq)
    assert tokens == ({9} if ignore_eos else {1, 3, 9})
    assert limit == 64 - 20
