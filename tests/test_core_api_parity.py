"""The core's side of the vLLM-parity sampling fields: top-k and prompt logprobs carried from ``StepDone`` into
``EmitTokens`` with their columns aligned, prompt logprobs only with output 0 of a request that asked, no prefix-cache
hit for such a request, the thinking budget's forced token, and the arrival checks of ``logit_bias`` and
``allowed_token_ids``."""

from __future__ import annotations

import math

import pytest
from core_harness import Harness, arrival
from core_state import commands_of, make_core, tick

from tickloom.engine.core import CoreConfig, InvariantViolation
from tickloom.engine.core.context import TickContext
from tickloom.events import NOT_FED, EmitTokens, Finish, RunStep, SamplingSpec, StepDone


def _same(a: list[float] | None, b: list[float]) -> bool:
    """Equal lists of floats, NaN equal to NaN."""
    return a is not None and len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in
                                                      zip(a, b, strict=True))


# -- TickContext.emit: the lazily created columns ----------------------------------------------------------------


def test_optional_columns_are_padded_for_the_entries_before_them() -> None:
    ctx = TickContext()
    ctx.emit("a", 5, 0, False, None)
    ctx.emit("b", 6, 0, False, -0.5, ([6, 7], [-0.5, -1.0]), ([-1.25], [[3]], [[-0.75]]))
    ctx.emit("a", 8, 1, False, None)
    ctx.flush_emits()
    [emit] = ctx.commands
    assert isinstance(emit, EmitTokens)
    assert emit.request_ids == ["a", "b", "a"] and emit.token_ids == [5, 6, 8] and emit.token_indices == [0, 0, 1]
    assert _same(emit.logprobs, [math.nan, -0.5, math.nan])
    assert emit.top_token_ids == [[], [6, 7], []] and emit.top_logprobs == [[], [-0.5, -1.0], []]
    assert emit.prompt_logprobs == [[], [-1.25], []]
    assert emit.prompt_top_token_ids == [[], [[3]], []] and emit.prompt_top_logprobs == [[], [[-0.75]], []]
    ctx.emit("c", 9, 0, False, None)
    ctx.flush_emits()
    assert ctx.commands[-1] == EmitTokens(["c"], [9], [0], [False]), "a flush starts the columns afresh"


def test_top_k_alone_starts_its_columns_without_a_logprob_column_change() -> None:
    ctx = TickContext()
    ctx.emit("a", 1, 0, False, -0.25)
    ctx.emit("a", 2, 1, False, -0.5)
    ctx.emit("b", 3, 0, False, -0.75, ([3], [-0.75]))
    ctx.flush_emits()
    [emit] = ctx.commands
    assert isinstance(emit, EmitTokens)
    assert emit.logprobs == [-0.25, -0.5, -0.75]
    assert emit.top_token_ids == [[], [], [3]] and emit.top_logprobs == [[], [], [-0.75]]
    assert emit.prompt_logprobs is None


# -- settling: a request without logprobs emits before one with them, in one tick -------------------------------


def test_a_request_without_logprobs_emits_before_one_with_them_and_the_columns_line_up() -> None:
    core = make_core(num_blocks=32, max_seq_len=128, pipeline_depth=2)
    [step0] = commands_of(tick(core, arrival("a", 10, 8)), RunStep)
    params = SamplingSpec(max_tokens=8, logprobs=True, top_logprobs=2, prompt_logprobs=1)
    [step1] = commands_of(tick(core, arrival("b", [5, 6, 7, 8], params=params)), RunStep)
    assert step0.request_ids == ["a"] and step1.request_ids == ["a", "b"]
    assert step1.fed_from == [0, NOT_FED], "a's decode row runs ahead of step 0; b prefills"
    prompt = [[-1.0, -2.0, -3.0]]
    out = tick(
        core,
        StepDone(0, ["a"], [7]),
        StepDone(1, ["a", "b"], [8, 9], logprobs=[-0.25, -0.5], top_token_ids=[[], [9, 4]],
                 top_logprobs=[[], [-0.5, -1.5]], prompt_logprobs=[[], prompt[0]],
                 prompt_top_token_ids=[[], [[6], [7], [9]]], prompt_top_logprobs=[[], [[-1.0], [-2.0], [-0.5]]]),
    )
    [emit] = commands_of(out, EmitTokens)
    assert emit.request_ids == ["a", "a", "b"] and emit.token_ids == [7, 8, 9] and emit.token_indices == [0, 1, 0]
    assert _same(emit.logprobs, [math.nan, -0.25, -0.5]), "a's first token came from a step without logprobs"
    assert emit.top_token_ids == [[], [], [9, 4]] and emit.top_logprobs == [[], [], [-0.5, -1.5]]
    assert emit.prompt_logprobs == [[], [], [-1.0, -2.0, -3.0]]
    assert emit.prompt_top_token_ids == [[], [], [[6], [7], [9]]]
    assert emit.prompt_top_logprobs == [[], [], [[-1.0], [-2.0], [-0.5]]]


def test_prompt_logprobs_ride_only_on_output_0_of_a_request_that_asked() -> None:
    core = make_core(num_blocks=32, max_seq_len=128)
    asks = SamplingSpec(max_tokens=4, prompt_logprobs=0)
    tick(core, arrival("p", [1, 2, 3], params=asks), arrival("q", [4, 5, 6]))
    both = dict(prompt_logprobs=[[-1.0, -2.0], [-3.0, -4.0]], prompt_top_token_ids=[[[], []], [[], []]],
                prompt_top_logprobs=[[[], []], [[], []]])
    [emit] = commands_of(tick(core, StepDone(0, ["p", "q"], [10, 11], **both)), EmitTokens)  # type: ignore[arg-type]
    assert emit.prompt_logprobs == [[-1.0, -2.0], []], "q did not ask: its entry is dropped"
    [emit] = commands_of(tick(core, StepDone(1, ["p", "q"], [12, 13], **both)), EmitTokens)  # type: ignore[arg-type]
    assert emit.prompt_logprobs is None, "output 1 carries none, whatever the device reports"


def test_a_step_result_whose_logprob_columns_do_not_line_up_is_refused() -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    tick(core, arrival("r", 10, 4))
    with pytest.raises(InvariantViolation, match="top-k ids and logprobs do not line up"):
        tick(core, StepDone(0, ["r"], [7], top_token_ids=[[7, 8]], top_logprobs=[[-0.5]]))
    core = make_core(num_blocks=16, max_seq_len=128)
    tick(core, arrival("r", 10, 4))
    with pytest.raises(InvariantViolation, match="length differs"):
        tick(core, StepDone(0, ["r"], [7], prompt_logprobs=[[], []]))
    core = make_core(num_blocks=16, max_seq_len=128)
    tick(core, arrival("r", 10, 4))
    with pytest.raises(InvariantViolation, match="top-k ids and logprobs do not line up"):
        tick(core, StepDone(0, ["r"], [7], top_token_ids=[[7]]))


# -- the prefix cache ---------------------------------------------------------------------------------------------


def test_a_request_asking_for_prompt_logprobs_gets_no_prefix_cache_hit() -> None:
    config = CoreConfig(num_blocks=64, block_size=8, max_seq_len=128, eos_token_ids=(1,))
    h = Harness(config)
    prompt = list(range(100, 140))
    h.step(arrival("first", prompt, 4))
    h.run()
    h.step(arrival("asks", prompt, 4, params=SamplingSpec(max_tokens=4, prompt_logprobs=2)),
           arrival("plain", prompt, 4))
    h.run()
    finishes = {c.request_id: c for _, c in h.commands(Finish)}
    assert finishes["plain"].usage.cached_prompt_tokens == 32, "four of its five blocks hit"
    assert finishes["asks"].usage.cached_prompt_tokens == 0, "every prompt position computed"
    first_rows = {}
    for _, step in h.commands(RunStep):
        for rid, position in zip(step.request_ids, step.positions, strict=True):
            first_rows.setdefault(rid, position)
    assert first_rows["asks"] == 0 and first_rows["plain"] == 32


def test_after_output_0_a_prompt_logprobs_request_may_hit_the_cache_again() -> None:
    from tickloom.engine.core.prefix_cache import may_hit_cache
    from tickloom.engine.core.state import Seq

    seq = Seq("r", 0, 0, [1, 2, 3], SamplingSpec(prompt_logprobs=0), 0, None, "")
    assert not may_hit_cache(seq)
    seq.outputs.append(5)
    assert may_hit_cache(seq), "a requeued request with output 0 delivered recomputes its history from the cache"
    assert may_hit_cache(Seq("s", 1, 0, [1, 2], SamplingSpec(), 1, None, ""))


# -- the thinking budget ------------------------------------------------------------------------------------------


def test_a_zero_thinking_budget_keeps_the_sampling_prefill_when_prompt_logprobs_are_asked() -> None:
    think_start, think_end = 5, 6
    core = make_core(num_blocks=16, max_seq_len=128, think_start_token=think_start, think_end_token=think_end)
    plain = SamplingSpec(max_tokens=4, thinking_budget=0)
    out = tick(core, arrival("plain", [20, 21, think_start], params=plain))
    [emit] = commands_of(out, EmitTokens)
    assert emit.token_ids == [think_end], "forced at arrival: the prefill samples nothing"
    [step] = commands_of(out, RunStep)
    assert step.sample_indices == [-1]
    asks = SamplingSpec(max_tokens=4, thinking_budget=0, prompt_logprobs=0)
    core = make_core(num_blocks=16, max_seq_len=128, think_start_token=think_start, think_end_token=think_end)
    out = tick(core, arrival("asks", [20, 21, think_start], params=asks))
    assert commands_of(out, EmitTokens) == []
    [step] = commands_of(out, RunStep)
    assert step.sample_indices == [0], "the prefill samples output 0, which reports the prompt logprobs"
    out = tick(core, StepDone(0, ["asks"], [30], prompt_logprobs=[[-1.0, -2.0]],
                               prompt_top_token_ids=[[[], []]], prompt_top_logprobs=[[[], []]]))
    [emit] = commands_of(out, EmitTokens)
    assert emit.token_ids == [think_end], "the budget forces think-end over the sampled token"
    assert emit.prompt_logprobs == [[-1.0, -2.0]] and emit.logprobs is None


# -- arrivals -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "problem"), [
    (SamplingSpec(allowed_token_ids=[]), "allowed_token_ids is empty: no token could be sampled"),
    (SamplingSpec(allowed_token_ids=[3, 1000]), "allowed_token_ids contains 1000, outside vocab_size=1000"),
    (SamplingSpec(allowed_token_ids=[-1]), "allowed_token_ids contains -1, outside vocab_size=1000"),
    (SamplingSpec(logit_bias=[(1000, 1.0)]), "logit_bias names token 1000, outside vocab_size=1000"),
    (SamplingSpec(logit_bias=[(2, math.nan)]), "logit_bias of token 2 is nan, not finite"),
    (SamplingSpec(logit_bias=[(2, math.inf)]), "logit_bias of token 2 is inf, not finite"),
])
def test_arrivals_with_bad_bias_or_allowed_tokens_are_rejected(params: SamplingSpec, problem: str) -> None:
    core = make_core(num_blocks=16, max_seq_len=128, vocab_size=1000)
    out = tick(core, arrival("r", 4, params=params))
    [finish] = commands_of(out, Finish)
    assert finish.reason == "error" and finish.error == f"request rejected: {problem}"
    assert commands_of(out, RunStep) == [] and not core.state.seqs


def test_arrivals_with_good_bias_and_allowed_tokens_are_admitted() -> None:
    core = make_core(num_blocks=16, max_seq_len=128, vocab_size=1000)
    params = SamplingSpec(logit_bias=[(0, -100.0), (999, 100.0)], allowed_token_ids=[0, 999])
    out = tick(core, arrival("r", 4, params=params))
    assert commands_of(out, Finish) == [] and "r" in core.state.seqs
