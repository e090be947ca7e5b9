"""Extra tokens: a step accepts tokens after a row's sampled one without a forward pass of their own.

A constraint that admits exactly one continuation forces them (jump-forward decoding); speculative decoding's
verified tokens come the same way, with their KV already written (``test_core_speculation.py``). The core commits
them in order through the stop rules, writes their KV with the sequence's next row (a catch-up row that also
samples), and voids the row that running ahead planned for the output the first extra token now is. Each rule has a
test that fails if that rule alone broke, driving ``SchedulerCore`` with hand-built inputs; the blasts at the end run
every actor's timing at random with the oracle's extras on.
"""

from __future__ import annotations

import pytest
from core_state import add_seq, hold_blocks, make_core
from test_core_blast import blast_config, random_config, run_blast

from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.engine.core.context import TickContext
from tickloom.engine.core.errors import InvariantViolation
from tickloom.engine.core.invariants import check_bounds
from tickloom.engine.core.preemption import take_off_device
from tickloom.engine.core.status import Status
from tickloom.events import (
    NO_SAMPLE,
    NOT_FED,
    EmitTokens,
    Finish,
    Input,
    Preempted,
    RequestArrived,
    RunStep,
    SamplingSpec,
    SpillOut,
    StepDone,
    TickInputs,
    TickOutputs,
)

EOS = 2
PROMPT = list(range(10, 30))  # 20 tokens


def _core(depth: int = 1, **kw: object) -> SchedulerCore:
    base = dict(num_blocks=32, block_size=16, max_seq_len=128, max_batch_size=4, max_prefill_tokens=64,
                max_batch_tokens=64, eos_token_ids=(EOS,), vocab_size=1000, pipeline_depth=depth)
    base.update(kw)
    return SchedulerCore(CoreConfig(**base))  # type: ignore[arg-type]


class Driver:
    """Feeds ticks; remembers each step so that a test can answer it by hand."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self.tick = -1
        self.steps: dict[int, RunStep] = {}
        self.emitted: list[tuple[int, int]] = []  # (index, token) of request "r"
        self.finish: Finish | None = None

    def run(self, *inputs: Input) -> TickOutputs:
        self.tick += 1
        out = self.core.tick(TickInputs(self.tick, self.tick * 1000, list(inputs)))
        for c in out.commands:
            if isinstance(c, RunStep):
                self.steps[c.step_id] = c
            elif isinstance(c, EmitTokens):
                self.emitted += [(i, t) for rid, i, t in zip(c.request_ids, c.token_indices, c.token_ids, strict=True)
                                 if rid == "r"]
            elif isinstance(c, Finish) and c.request_id == "r":
                self.finish = c
        self.core.check_invariants()
        return out

    def done(self, step_id: int, token: int, extras: list[int] | None = None) -> TickOutputs:
        step = self.steps[step_id]
        ids = [rid for rid, k in zip(step.request_ids, step.sample_indices, strict=True) if k != NO_SAMPLE]
        assert ids == ["r"]
        return self.run(StepDone(step_id, ids, [token], extra_token_ids=None if extras is None else [extras]))

    def row(self, step_id: int) -> tuple[int, int, list[int], int, int]:
        """(position, num_tokens, input tokens, fed_from, sample index) of r's row in the step."""
        step = self.steps[step_id]
        i = step.request_ids.index("r")
        start = sum(step.num_tokens[:i])
        return (step.positions[i], step.num_tokens[i], step.token_ids[start : start + step.num_tokens[i]],
                step.fed_from[i], step.sample_indices[i])


def _arrive(max_tokens: int = 50, **kw: object) -> RequestArrived:
    return RequestArrived("r", PROMPT, SamplingSpec(max_tokens=max_tokens, **kw), seed=7)  # type: ignore[arg-type]


def test_depth1_extras_are_committed_in_order_and_the_next_row_writes_them_and_samples() -> None:
    d = Driver(_core())
    d.run(_arrive())
    assert d.row(0) == (0, 20, PROMPT, NOT_FED, 0)
    d.done(0, 100, [101, 102, 103])
    assert d.emitted == [(0, 100), (1, 101), (2, 102), (3, 103)]
    # The catch-up row: the pending token and the extras, all known, from the first position without KV.
    assert d.row(1) == (20, 4, [100, 101, 102, 103], NOT_FED, 4)
    d.done(1, 104)
    assert d.emitted[-1] == (4, 104)
    assert d.row(2) == (24, 1, [104], NOT_FED, 5), "back to one-token decode rows"


def test_depth2_the_row_fed_from_the_step_is_void_and_emits_nothing() -> None:
    d = Driver(_core(depth=2))
    d.run(_arrive())
    d.run()  # nothing settles: step 0 in flight, no second step (prefill samples output 0 first)
    d.done(0, 100)
    assert d.row(1) == (20, 1, [0], 0, 1), "running ahead: fed from step 0"
    d.done(1, 200, [201, 202])  # output 1 = 200, then extras 2, 3
    assert d.row(2) == (21, 1, [0], 1, 2)
    seq = d.core.state.seqs["r"]
    assert seq.void == 1 and seq.catch_up == 0, "void until step 2 settles; the catch-up row is already planned"
    # Step 2 is in flight and void: the catch-up row (step 3) is not fed from it; it writes 201, 202 and samples 4.
    assert d.row(3) == (22, 2, [201, 202], NOT_FED, 4)
    before = list(d.emitted)
    d.done(2, 999)  # the void row's token is never streamed or counted
    assert d.emitted == before and seq.void == 0 and seq.outputs == [100, 200, 201, 202]
    d.done(3, 300)
    assert d.emitted[-1] == (4, 300)


def test_a_stop_token_among_the_extras_finishes_there_and_drops_the_rest() -> None:
    d = Driver(_core())
    d.run(_arrive())
    d.done(0, 100, [101, EOS, 103])
    assert d.finish is not None and d.finish.reason == "stop"
    assert [t for _, t in d.emitted] == [100, 101, EOS]
    assert d.finish.usage.completion_tokens == 3


def test_max_tokens_inside_the_extras_finishes_with_length() -> None:
    d = Driver(_core())
    d.run(_arrive(max_tokens=3))
    d.done(0, 100, [101, 102, 103, 104])
    assert d.finish is not None and d.finish.reason == "length"
    assert [t for _, t in d.emitted] == [100, 101, 102]


def test_the_context_limit_inside_the_extras_finishes_with_length() -> None:
    d = Driver(_core(max_seq_len=23))
    d.run(_arrive())
    d.done(0, 100, [101, 102, 103, 104])
    assert d.finish is not None and d.finish.reason == "length"
    assert len(d.emitted) == 3, "prompt 20 + 3 outputs fill max_seq_len 23"


def test_a_catch_up_row_larger_than_the_prefill_budget_is_split_and_samples_only_at_its_end() -> None:
    d = Driver(_core(max_prefill_tokens=3))
    d.run(_arrive())
    for step_id in range(6):  # the prompt in chunks of 3: 0..18 sample nothing, [18, 20) samples output 0
        d.run(StepDone(step_id, [], []))
    d.done(6, 100, [101, 102, 103, 104, 105])
    assert d.row(7) == (20, 3, [100, 101, 102], NOT_FED, NO_SAMPLE)
    assert d.core.state.seqs["r"].catch_up == 2
    d.run(StepDone(7, [], []))
    assert d.row(8) == (23, 3, [103, 104, 105], NOT_FED, 6), "the rest, through the pending token, samples"
    assert d.core.state.seqs["r"].catch_up == 0


@pytest.mark.parametrize(("spill", "mode"), [(False, "requeue"), (True, "swap")])
def test_a_sequence_with_extras_pending_is_preempted_with_its_history_intact(spill: bool, mode: str) -> None:
    """Requeued, its whole history is prefilled again on resume; swapped, its settled KV is spilled and the extras
    still without KV are written by the catch-up row after the swap-in."""
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128, spill_enabled=spill)
    state = core.state
    seq = add_seq(state, "r", 20, outputs=5)
    hold_blocks(state, seq, 2)
    seq.num_computed = seq.kv_settled = 22  # outputs 3 and 4 came as extras: KV through output 1
    seq.catch_up = 2
    ctx = TickContext()
    take_off_device(state, ctx, seq)
    assert [c.mode for c in ctx.commands if isinstance(c, Preempted)] == [mode]
    if mode == "requeue":
        assert seq.catch_up == 0 and seq.status is Status.PREEMPTED
        assert seq.prefill_target == 24, "the history minus the pending token is prefilled on resume"
    else:
        assert seq.catch_up == 2 and seq.spill_tokens == 22 and seq.status is Status.SWAPPING
        spill = next(c for c in ctx.commands if isinstance(c, SpillOut))
        assert spill.num_tokens == 22, "only the settled KV is spilled"


def test_more_void_rows_than_rows_in_flight_is_an_invariant_violation() -> None:
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128, pipeline_depth=2)
    seq = add_seq(core.state, "r", 20, outputs=2)
    hold_blocks(core.state, seq, 2)
    seq.inflight, seq.void = 1, 1
    check_bounds(core.state)
    seq.void = 2
    with pytest.raises(InvariantViolation, match="void rows"):
        check_bounds(core.state)


def test_without_extras_the_bulk_settle_path_is_kept() -> None:
    """``void_rows`` stays 0 and the lane survives when no step carries extras (the golden digests pin this too)."""
    d = Driver(_core(depth=2))
    d.run(_arrive())
    d.done(0, 100)
    d.done(1, 101)
    assert d.core.state.void_rows == 0 and d.core.state.lane is not None


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("spill", [False, True])
def test_blast_with_extras_keeps_every_invariant_and_the_oracle_tokens(depth: int, spill: bool) -> None:
    """Random arrivals, cancels, deadlines, stop matches, failures, preemption and swaps with extras on: every
    request ends once with exactly the oracle's tokens (the same with or without extras), nothing leaks."""
    h = run_blast(9100 + depth * 10 + spill, 500, blast_config(depth, spill, True, 24), extras=3)
    steps = [c for out in h.outputs for c in out.commands if isinstance(c, RunStep)]
    catch_up_rows = sum(1 for s in steps for n, k in zip(s.num_tokens, s.sample_indices, strict=True)
                        if n > 1 and k > 0)
    assert catch_up_rows > 20, "the oracle's extras made catch-up rows"


@pytest.mark.parametrize("seed", range(2700, 2706))
def test_random_config_blast_with_extras(seed: int) -> None:
    run_blast(seed, 300, random_config(seed), shutdown=seed % 3 == 0, extras=4)
