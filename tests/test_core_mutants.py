"""Rules pinned at their edges, found by mutation testing (``scripts/mutate.sh``): each test asserts one rule of
ARCHITECTURE.md and the scenario ids through the commands the core emits and its snapshot, at the boundary where a
slightly wrong rule (an off-by-one, a dropped term, a flipped condition) behaves differently.
"""

from __future__ import annotations

import hashlib

import pytest
from core_harness import TICK_NS, Harness, arrival
from core_state import (
    THINK_END,
    THINK_START,
    add_seq,
    bound,
    cache_prefix_of,
    cache_unrelated,
    commands_of,
    hold_blocks,
    make_core,
    snap_seq,
    tick,
    waiting_ids,
)

from tickloom.engine.core import CoreConfig, InvariantViolation, SchedulerCore
from tickloom.engine.core.prefix_cache import cache_full_blocks
from tickloom.engine.core.state import Seq
from tickloom.engine.core.status import Status
from tickloom.events import (
    BindRequest,
    ClientGone,
    EmitTokens,
    Finish,
    ReleaseRequest,
    RequestCancelled,
    RunStep,
    SamplingSpec,
    Shutdown,
    SpillOut,
    StepDone,
    Usage,
)
from tickloom.replay.oracle import OracleExecutor

# -- C03: in-flight demand ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("head_prompt", "admitted"), [(100, True), (112, False)])
def test_c03_demand_counts_only_the_unallocated_part_of_a_reservation(head_prompt: int, admitted: bool) -> None:
    core = make_core(num_blocks=20, block_size=16, max_seq_len=128)
    state = core.state
    holder = add_seq(state, "holder", 40, outputs=1)
    hold_blocks(state, holder, 10)
    holder.reserve = 13  # admitted with a watermark: 3 of its 13 blocks are still promised to it
    state.reserving.append(holder)
    # 10 free - 3 promised = 7: blocks(100) = 7 fits, blocks(112) = 8 does not.
    out = tick(core, arrival("head", head_prompt, 4))
    assert (bound(out) == ["head"]) is admitted
    assert waiting_ids(core.snapshot()) == ([] if admitted else ["head"])


@pytest.mark.parametrize(("free", "admitted"), [(11, True), (10, False)])
def test_c03_a_parked_sequence_counts_its_need_plus_one(free: int, admitted: bool) -> None:
    core = make_core(num_blocks=20, block_size=16, max_seq_len=128)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 100, outputs=1), 20 - free)
    add_seq(state, "parked", 20, outputs=13, status=Status.PREEMPTED)  # a 32-token history: 3 blocks, wants 4
    out = tick(core, arrival("head", 100, 8))  # blocks(100) = 7
    assert (bound(out) == ["head"]) is admitted, f"{free} free - 4 promised against 7"


@pytest.mark.parametrize(("head_prompt", "admitted"), [(150, True), (160, False)])
def test_c03_demand_adds_up_reservations_and_every_parked_sequence(head_prompt: int, admitted: bool) -> None:
    core = make_core(num_blocks=24, block_size=16, max_seq_len=192)
    state = core.state
    holder = add_seq(state, "holder", 40, outputs=1)
    hold_blocks(state, holder, 6)
    holder.reserve = 8  # 2 promised
    state.reserving.append(holder)
    add_seq(state, "p1", 20, outputs=13, status=Status.PREEMPTED)  # a 32-token history: 3 blocks, wants 4
    add_seq(state, "p2", 10, outputs=6, status=Status.PREEMPTED)  # a 15-token history: 1 block, wants 2
    # 18 free - (2 + 4 + 2) promised = 10: blocks(150) = 10 fits, blocks(160) = 11 does not.
    out = tick(core, arrival("head", head_prompt, 4))
    assert (bound(out) == ["head"]) is admitted


# -- C03 / C18: the prefix hits the gate discounts --------------------------------------------------------------


def _sharing_core(prompt_len: int, free: int) -> tuple[SchedulerCore, list[int]]:
    """``a`` runs a ``prompt_len``-token prompt whose full blocks are registered in the cache (in use by ``a``,
    so nothing is reclaimable); ``free`` blocks are free."""
    core = make_core(num_blocks=20, block_size=16, max_seq_len=128)
    state = core.state
    a = add_seq(state, "a", prompt_len, outputs=1)
    hold_blocks(state, a, 5)
    assert len(cache_full_blocks(state, a, prompt_len)) == 4
    hold_blocks(state, add_seq(state, "filler", 10, outputs=1), 15 - free)
    return core, list(a.prompt)


@pytest.mark.parametrize(("prompt_len", "free", "admitted"), [(64, 2, True), (64, 1, False), (65, 1, True)])
def test_c03_c18_the_gate_discounts_hits_but_never_the_last_prompt_token(
    prompt_len: int, free: int, admitted: bool
) -> None:
    # blocks(64) = blocks(65) = 5. A 64-token prompt's 4th full block holds its last token, which is always
    # recomputed: 3 blocks hit and the head needs 2 free. A 65-token prompt's 4 full blocks all hit: it needs 1.
    core, prompt = _sharing_core(prompt_len, free)
    out = tick(core, arrival("head", prompt, 4))
    assert (bound(out) == ["head"]) is admitted
    if admitted:
        [step] = commands_of(out, RunStep)
        i = step.request_ids.index("head")
        hit = 16 * ((prompt_len - 1) // 16)
        assert step.positions[i] == hit and step.num_tokens[i] == prompt_len - hit, "it computes after its hits"


def test_c03_c18_admission_reclaim_never_evicts_the_heads_own_hits() -> None:
    core = make_core(num_blocks=20, block_size=16, max_seq_len=128)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 100, outputs=1), 14)
    template = Seq("t", 99, 0, [100 + i for i in range(65)], SamplingSpec(max_tokens=4), 0, None, "")
    own = cache_prefix_of(state, template, 64)  # the head's 4 full blocks, least recently used
    cache_unrelated(state, 2)
    unrelated = list(state.pool.cached)[4:]
    assert state.pool.num_free == 0
    out = tick(core, arrival("head", template.prompt, 4))  # blocks(65) = 5, 4 hit: short by 1
    assert bound(out) == ["head"]
    [step] = commands_of(out, RunStep)
    i = step.request_ids.index("head")
    assert (step.positions[i], step.num_tokens[i]) == (64, 1), "all 4 hits survived the reclaim"
    head = snap_seq(core.snapshot(), "head")
    assert head.block_ids[:4] == own and head.block_ids[4] == unrelated[0], "the oldest unrelated block was evicted"


# -- C03: swap-out at admission (spill store) ------------------------------------------------------------------


def _swap_core(free: int, *victims: int) -> SchedulerCore:
    """Spill on; ``big`` (immune) holds the rest; each of ``victims`` is a settled, decoding, non-immune sequence
    holding that many blocks, ``v0`` admitted first."""
    core = make_core(num_blocks=24, block_size=16, max_seq_len=128, spill_enabled=True)
    state = core.state
    big = add_seq(state, "big", 100, outputs=5)
    hold_blocks(state, big, 24 - free - sum(victims))
    big.immune_until = 5 + 64
    for i, n in enumerate(victims):
        hold_blocks(state, add_seq(state, f"v{i}", 16 * n - 2, outputs=1), n)
    return core


@pytest.mark.parametrize(("victim", "admitted"), [(4, True), (3, False)])
def test_c03_admission_swaps_only_when_every_candidate_would_cover_the_shortfall(victim: int, admitted: bool) -> None:
    core = _swap_core(3, victim)
    out = tick(core, arrival("head", 100, 4))  # blocks(100) = 7, 3 free: short by 4
    spilled = [c.request_id for c in commands_of(out, SpillOut)]
    assert spilled == (["v0"] if admitted else []), "a swap that cannot make the head fit is not made"
    assert (bound(out) == ["head"]) is admitted


def test_c03_admission_swaps_until_the_head_fits() -> None:
    core = _swap_core(2, 4, 2)
    out = tick(core, arrival("head", 100, 4))  # short by 5: v0 (4 blocks) leaves it short by 1, then v1
    assert [c.request_id for c in commands_of(out, SpillOut)] == ["v0", "v1"]
    assert bound(out) == ["head"]
    snap = core.snapshot()
    assert len(snap_seq(snap, "head").block_ids) == 7 and len(snap.pool.free) == 1


def test_c03_admission_shared_blocks_swapped_out_free_nothing() -> None:
    # v0 and v1 share a registered 2-block prefix: swapping both frees 2 + 2 = 4 blocks, not the 6 they hold.
    core = make_core(num_blocks=24, block_size=16, max_seq_len=128, spill_enabled=True)
    state = core.state
    big = add_seq(state, "big", 100, outputs=5)
    hold_blocks(state, big, 18)
    big.immune_until = 5 + 64
    v0 = add_seq(state, "v0", 40, outputs=1)
    hold_blocks(state, v0, 3)
    assert len(cache_full_blocks(state, v0, 32)) == 2
    v1 = add_seq(state, "v1", 40, outputs=1)
    v1.prompt = list(v0.prompt)
    [own] = state.pool.allocate(1)
    state.pool.claim(v0.block_ids[:2])
    v1.block_ids, v1.sent_blocks, v1.num_computed, v1.kv_settled = [*v0.block_ids[:2], own], 3, 40, 40
    v1.first_planned, v1.reserve = True, 3
    assert state.pool.num_free == 2
    out = tick(core, arrival("head", 100, 4))  # 7 blocks, 2 free: short by 5 < 6 held, but only 4 come free
    assert [c.request_id for c in commands_of(out, SpillOut)] == ["v1", "v0"], "most blocks, then latest admitted"
    assert bound(out) == [], "still short after swapping every candidate: the head waits"
    assert waiting_ids(core.snapshot()) == ["head"]


@pytest.mark.parametrize(("parked_prompt", "admitted"), [(20, True), (100, False)])
def test_c03_a_lone_head_reserves_its_prompt_only_if_that_fits(parked_prompt: int, admitted: bool) -> None:
    # Nothing runs. The head wants blocks(127 + 16) = 9 with the watermark, blocks(127) = 8 alone, of 12 blocks
    # less what the parked sequence is promised: a 32-token history wants 4 (8 left: the prompt alone fits), a
    # 112-token one wants 9 (3 left: not even the prompt fits).
    core = make_core(num_blocks=12, block_size=16, max_seq_len=128, admit_watermark=16)
    add_seq(core.state, "parked", parked_prompt, outputs=13, status=Status.PREEMPTED)
    out = tick(core, arrival("head", 127, 100))
    snap = core.snapshot()
    if admitted:
        assert bound(out) == ["head"] and snap_seq(snap, "head").reserve == 8, "the watermark is waived alone"
    else:
        assert bound(out) == [] and waiting_ids(snap) == ["head"]
    assert snap_seq(snap, "parked").status is Status.RUNNING, "the parked one resumed at the end of the tick"


# -- C02: every invalid arrival is answered at once, naming its problem -----------------------------------------


@pytest.mark.parametrize(
    ("params", "prompt", "problem"),
    [
        (SamplingSpec(max_tokens=0), 10, "max_tokens=0 must be at least 1"),
        (SamplingSpec(max_tokens=4, min_tokens=-1), 10, "min_tokens=-1 must be between 0 and max_tokens=4"),
        (SamplingSpec(max_tokens=4, min_tokens=5), 10, "min_tokens=5 must be between 0 and max_tokens=4"),
        (SamplingSpec(max_tokens=4, thinking_budget=-1), 10, "thinking_budget=-1 must not be negative"),
        (SamplingSpec(max_tokens=4), [3, 1000], "prompt token id 1000 at position 1 is outside vocab_size=1000"),
        (SamplingSpec(max_tokens=4), [-1, 3], "prompt token id -1 at position 0 is outside vocab_size=1000"),
        (SamplingSpec(max_tokens=4), [0, 1000], "prompt token id 1000 at position 1 is outside vocab_size=1000"),
        (SamplingSpec(max_tokens=4), [], "empty prompt"),
        (SamplingSpec(max_tokens=4), 128, "prompt of 128 tokens does not fit max_seq_len=128"),
    ],
)
def test_c02_an_invalid_arrival_is_rejected_naming_its_problem(
    params: SamplingSpec, prompt: list[int] | int, problem: str
) -> None:
    core = make_core(num_blocks=16, max_seq_len=128, vocab_size=1000)
    out = tick(core, arrival("bad", prompt, params=params))
    n = prompt if isinstance(prompt, int) else len(prompt)
    assert out.commands == [Finish("bad", "error", Usage(n, 0, 0), f"request rejected: {problem}")]
    assert core.snapshot().live == 0


@pytest.mark.parametrize(
    ("params", "prompt"),
    [
        (SamplingSpec(max_tokens=1), 10),
        (SamplingSpec(max_tokens=4, min_tokens=4), 10),
        (SamplingSpec(max_tokens=4, min_tokens=0, thinking_budget=0), 10),
        (SamplingSpec(max_tokens=4), [0, 999]),
        (SamplingSpec(max_tokens=1), 127),
    ],
)
def test_c02_an_arrival_at_the_edge_of_validity_is_accepted(params: SamplingSpec, prompt: list[int] | int) -> None:
    core = make_core(num_blocks=16, max_seq_len=128, vocab_size=1000)
    out = tick(core, arrival("ok", prompt, params=params))
    assert bound(out) == ["ok"] and not commands_of(out, Finish)


def test_c02_the_waiting_queue_bound_rejects_the_arrival_that_would_exceed_it() -> None:
    core = make_core(num_blocks=16, max_seq_len=128, max_batch_size=1, max_waiting=2)
    out = tick(core, arrival("a", 10, 4), arrival("b", 10, 4), arrival("c", 10, 4))
    assert commands_of(out, Finish) == [Finish("c", "error", Usage(10, 0, 0),
                                       "request rejected: waiting queue is full (max_waiting=2)")]
    assert bound(out) == ["a"] and waiting_ids(core.snapshot()) == ["b"]


def test_c25_an_arrival_after_shutdown_is_rejected() -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    tick(core, Shutdown())
    out = tick(core, arrival("late", 10, 4))
    assert out.commands == [Finish("late", "error", Usage(10, 0, 0), "request rejected: the engine is shut down")]


def test_a_request_without_a_seed_gets_a_stable_one_from_its_arrival_and_id() -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    out = tick(core, arrival("first", 10, 4, seed=7), arrival("second", 10, 4, seed=None))
    expected = int.from_bytes(hashlib.blake2b(b"1:second", digest_size=8).digest(), "little") >> 1
    assert [(c.request_id, c.seed) for c in commands_of(out, BindRequest)] == [("first", 7), ("second", expected)]


# -- The tick applies its inputs grouped by kind, in the reference scheduler's order -------------------------


@pytest.mark.parametrize("kind", [RequestCancelled, ClientGone])
def test_inputs_arrivals_apply_before_cancels_in_the_same_tick(kind: type) -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    out = tick(core, kind("r"), arrival("r", 10, 4))
    assert [(c.request_id, c.reason) for c in commands_of(out, Finish)] == [("r", "cancelled")]
    assert bound(out) == []


@pytest.mark.parametrize("kind", [RequestCancelled, ClientGone])
def test_inputs_cancels_apply_before_step_results_in_the_same_tick(kind: type) -> None:
    h = Harness(CoreConfig(num_blocks=16, max_seq_len=128))
    h.step(arrival("r", 10, 8))
    h.step()
    assert len(h.tokens["r"]) == 1 and any(isinstance(i, StepDone) for i in h.pending)
    out = h.step(kind("r"))  # the harness lists the pending StepDone first
    assert not commands_of(out, EmitTokens), "the step's token for r is discarded: the cancel came first"
    assert h.finishes["r"].reason == "cancelled" and h.finishes["r"].usage.completion_tokens == 1


def test_c03_c18_a_lone_head_discounts_its_hits_too() -> None:
    # Nothing runs; 12 blocks, 2 of them cached with the head's prefix, 10 free, 4 promised to a parked sequence.
    # With the watermark the head needs 9 - 2 hits = 7 > 6; alone, 8 - 2 = 6: it fits, its hits protected.
    core = make_core(num_blocks=12, block_size=16, max_seq_len=128, admit_watermark=16)
    state = core.state
    add_seq(state, "parked", 20, outputs=13, status=Status.PREEMPTED)
    template = Seq("t", 99, 0, [100 + i for i in range(127)], SamplingSpec(max_tokens=100), 0, None, "")
    own = cache_prefix_of(state, template, 32)
    out = tick(core, arrival("head", template.prompt, 100))
    assert bound(out) == ["head"]
    head = snap_seq(core.snapshot(), "head")
    assert head.reserve == 8 and head.block_ids[:2] == own


# -- The executor's side: BindRequest once at admission, ReleaseRequest once at the end ---------------------------


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_bind_request_carries_the_masked_ids_and_the_prompt(ignore_eos: bool) -> None:
    core = make_core(num_blocks=16, max_seq_len=128, eos_token_ids=(2, 3))
    params = SamplingSpec(max_tokens=4, min_tokens=2, stop_token_ids=[3, 9], ignore_eos=ignore_eos)
    out = tick(core, arrival("r", [10, 11, 12], params=params, seed=5))
    masked = [3, 9] if ignore_eos else [2, 3, 9]  # EOS ids unless ignored, then the stop ids not among them
    assert commands_of(out, BindRequest) == [BindRequest("r", params, 5, 3, masked, [10, 11, 12])]


def test_release_request_once_for_every_admitted_request_and_none_for_others() -> None:
    h = Harness(CoreConfig(num_blocks=16, max_seq_len=128, max_batch_size=1))
    h.step(arrival("ran", 10, 2), arrival("waited", 10, 2), arrival("bad", [], 2))
    h.step(RequestCancelled("waited"))
    h.run()
    releases = [(t, c.request_id) for t, c in h.commands(ReleaseRequest)]
    assert [rid for _, rid in releases] == ["ran"], "never bound: nothing to release"
    [(finish_tick, _)] = [(t, c) for t, c in h.commands(Finish) if c.request_id == "ran"]
    assert releases[0][0] == finish_tick


# -- C20: think-end is forced as the next input, not sampled ------------------------------------------------------


def test_c20_think_end_is_forced_without_a_sampling_row() -> None:
    config = CoreConfig(num_blocks=16, max_seq_len=128, think_start_token=THINK_START, think_end_token=THINK_END)
    oracle = OracleExecutor(config.vocab_size, avoid=(THINK_START, THINK_END))
    h = Harness(config, oracle=oracle)
    h.step(arrival("r", [*range(100, 110), THINK_START], params=SamplingSpec(max_tokens=8, thinking_budget=3)))
    h.run()
    assert h.output("r")[3] == THINK_END and THINK_END not in h.output("r")[:3]
    emitted = {i: t for t, c in h.commands(EmitTokens) for i in c.token_indices}
    assert emitted[3] == emitted[2], "think-end streams in the tick the budget ran out"
    rows = [(s.sample_indices[0], s.token_ids[-1]) for _, s in h.commands(RunStep)]
    assert [i for i, _ in rows if i >= 0] == [0, 1, 2, 4, 5, 6, 7], "no row samples index 3"
    assert (4, THINK_END) in rows, "think-end is fed as an input, and the row after it samples index 4"


# -- A StepDone that contradicts its step is refused ------------------------------------------------------------


def test_a_step_result_for_the_wrong_output_index_is_an_invariant_violation() -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    [step] = commands_of(tick(core, arrival("r", 10, 4)), RunStep)
    core.state.seqs["r"].outputs.append(5)  # the core's record no longer matches the step it planned
    with pytest.raises(InvariantViolation) as raised:
        tick(core, StepDone(step.step_id, ["r"], [7], logprobs=[-0.5]))
    assert raised.value.invariant == "step results match their step"
    assert raised.value.detail == f"step {step.step_id} sampled output 0 of 'r', which has 1 outputs"


# -- C25: shutdown names the state of every parked request ------------------------------------------------------


def test_c25_shutdown_names_a_request_whose_spill_is_in_progress() -> None:
    core = make_core(num_blocks=16, max_seq_len=128, spill_enabled=True)
    seq = add_seq(core.state, "s", 20, outputs=5, status=Status.SWAPPING)
    seq.spill_tokens, seq.has_spill = 24, True
    out = tick(core, Shutdown())
    [finish] = commands_of(out, Finish)
    assert (finish.reason, finish.error) == ("error", "engine shut down while swapped out")


def test_c14_c25_a_deadline_due_in_the_shutdown_tick_wins_as_timeout() -> None:
    h = Harness(CoreConfig(num_blocks=16, max_seq_len=128))
    h.step(arrival("r", 10, 50, deadline_ns=3 * TICK_NS))
    h.step()
    h.step()
    out = h.step(Shutdown())  # now_ns == deadline_ns: the sweep times r out at the token shutdown ends it at
    [finish] = commands_of(out, Finish)
    assert (finish.request_id, finish.reason) == ("r", "timeout"), "timeout > error at the same token"
    assert finish.usage.completion_tokens == len(h.tokens["r"]) == 3
