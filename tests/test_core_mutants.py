"""Rules pinned at their edges, found by mutation testing (``scripts/mutate.sh``): each test asserts one rule of
ARCHITECTURE.md and the scenario ids through the commands the core emits and its snapshot, at the boundary where a
slightly wrong rule (an off-by-one, a dropped term, a flipped condition) behaves differently.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import pytest
from core_harness import TICK_NS, Harness, arrival
from core_state import add_seq, cache_prefix_of, cache_unrelated, hold_blocks, make_core
from core_state import bound as _bound
from core_state import commands_of as _of
from core_state import snap_seq as _snap_seq
from core_state import tick as _tick

from engine.core import CoreConfig, InvariantViolation, SchedulerCore
from engine.core.lifecycle import cache_full_blocks
from engine.core.snapshot import CoreSnapshot
from engine.core.state import CoreState, DecodeLane, Seq, Status
from events import (
    NO_SAMPLE,
    BindRequest,
    ClientGone,
    DeadlineReached,
    DropSpill,
    EmitTokens,
    Finish,
    Preempted,
    ReleaseRequest,
    RequestCancelled,
    RunStep,
    SamplingSpec,
    Shutdown,
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
from replay.oracle import OracleExecutor


def _waiting_ids(snap: CoreSnapshot) -> list[str]:
    return [snap.seqs[i].request_id for i in snap.waiting]

THINK_START, THINK_END = 5, 6


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
    out = _tick(core, arrival("head", head_prompt, 4))
    assert (_bound(out) == ["head"]) is admitted
    assert _waiting_ids(core.snapshot()) == ([] if admitted else ["head"])


@pytest.mark.parametrize(("free", "admitted"), [(11, True), (10, False)])
def test_c03_a_parked_sequence_counts_its_need_plus_one(free: int, admitted: bool) -> None:
    core = make_core(num_blocks=20, block_size=16, max_seq_len=128)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 100, outputs=1), 20 - free)
    add_seq(state, "parked", 20, outputs=13, status=Status.PREEMPTED)  # a 32-token history: 3 blocks, wants 4
    out = _tick(core, arrival("head", 100, 8))  # blocks(100) = 7
    assert (_bound(out) == ["head"]) is admitted, f"{free} free - 4 promised against 7"


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
    out = _tick(core, arrival("head", head_prompt, 4))
    assert (_bound(out) == ["head"]) is admitted


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
    out = _tick(core, arrival("head", prompt, 4))
    assert (_bound(out) == ["head"]) is admitted
    if admitted:
        [step] = _of(out, RunStep)
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
    out = _tick(core, arrival("head", template.prompt, 4))  # blocks(65) = 5, 4 hit: short by 1
    assert _bound(out) == ["head"]
    [step] = _of(out, RunStep)
    i = step.request_ids.index("head")
    assert (step.positions[i], step.num_tokens[i]) == (64, 1), "all 4 hits survived the reclaim"
    head = _snap_seq(core.snapshot(), "head")
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
    out = _tick(core, arrival("head", 100, 4))  # blocks(100) = 7, 3 free: short by 4
    spilled = [c.request_id for c in _of(out, SpillOut)]
    assert spilled == (["v0"] if admitted else []), "a swap that cannot make the head fit is not made"
    assert (_bound(out) == ["head"]) is admitted


def test_c03_admission_swaps_until_the_head_fits() -> None:
    core = _swap_core(2, 4, 2)
    out = _tick(core, arrival("head", 100, 4))  # short by 5: v0 (4 blocks) leaves it short by 1, then v1
    assert [c.request_id for c in _of(out, SpillOut)] == ["v0", "v1"]
    assert _bound(out) == ["head"]
    snap = core.snapshot()
    assert len(_snap_seq(snap, "head").block_ids) == 7 and len(snap.pool.free) == 1


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
    out = _tick(core, arrival("head", 100, 4))  # 7 blocks, 2 free: short by 5 < 6 held, but only 4 come free
    assert [c.request_id for c in _of(out, SpillOut)] == ["v1", "v0"], "most blocks, then latest admitted"
    assert _bound(out) == [], "still short after swapping every candidate: the head waits"
    assert _waiting_ids(core.snapshot()) == ["head"]


@pytest.mark.parametrize(("parked_prompt", "admitted"), [(20, True), (100, False)])
def test_c03_a_lone_head_reserves_its_prompt_only_if_that_fits(parked_prompt: int, admitted: bool) -> None:
    # Nothing runs. The head wants blocks(127 + 16) = 9 with the watermark, blocks(127) = 8 alone, of 12 blocks
    # less what the parked sequence is promised: a 32-token history wants 4 (8 left: the prompt alone fits), a
    # 112-token one wants 9 (3 left: not even the prompt fits).
    core = make_core(num_blocks=12, block_size=16, max_seq_len=128, admit_watermark=16)
    add_seq(core.state, "parked", parked_prompt, outputs=13, status=Status.PREEMPTED)
    out = _tick(core, arrival("head", 127, 100))
    snap = core.snapshot()
    if admitted:
        assert _bound(out) == ["head"] and _snap_seq(snap, "head").reserve == 8, "the watermark is waived alone"
    else:
        assert _bound(out) == [] and _waiting_ids(snap) == ["head"]
    assert _snap_seq(snap, "parked").status is Status.RUNNING, "the parked one resumed at the end of the tick"


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
    out = _tick(core, arrival("bad", prompt, params=params))
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
    out = _tick(core, arrival("ok", prompt, params=params))
    assert _bound(out) == ["ok"] and not _of(out, Finish)


def test_c02_the_waiting_queue_bound_rejects_the_arrival_that_would_exceed_it() -> None:
    core = make_core(num_blocks=16, max_seq_len=128, max_batch_size=1, max_waiting=2)
    out = _tick(core, arrival("a", 10, 4), arrival("b", 10, 4), arrival("c", 10, 4))
    assert _of(out, Finish) == [Finish("c", "error", Usage(10, 0, 0),
                                       "request rejected: waiting queue is full (max_waiting=2)")]
    assert _bound(out) == ["a"] and _waiting_ids(core.snapshot()) == ["b"]


def test_c25_an_arrival_after_shutdown_is_rejected() -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    _tick(core, Shutdown())
    out = _tick(core, arrival("late", 10, 4))
    assert out.commands == [Finish("late", "error", Usage(10, 0, 0), "request rejected: the engine is shut down")]


def test_a_request_without_a_seed_gets_a_stable_one_from_its_arrival_and_id() -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    out = _tick(core, arrival("first", 10, 4, seed=7), arrival("second", 10, 4, seed=None))
    expected = int.from_bytes(hashlib.blake2b(b"1:second", digest_size=8).digest(), "little") >> 1
    assert [(c.request_id, c.seed) for c in _of(out, BindRequest)] == [("first", 7), ("second", expected)]


# -- The tick applies its inputs grouped by kind, in the seed's order -----------------------------------------


@pytest.mark.parametrize("kind", [RequestCancelled, ClientGone])
def test_inputs_arrivals_apply_before_cancels_in_the_same_tick(kind: type) -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    out = _tick(core, kind("r"), arrival("r", 10, 4))
    assert [(c.request_id, c.reason) for c in _of(out, Finish)] == [("r", "cancelled")]
    assert _bound(out) == []


@pytest.mark.parametrize("kind", [RequestCancelled, ClientGone])
def test_inputs_cancels_apply_before_step_results_in_the_same_tick(kind: type) -> None:
    h = Harness(CoreConfig(num_blocks=16, max_seq_len=128))
    h.step(arrival("r", 10, 8))
    h.step()
    assert len(h.tokens["r"]) == 1 and any(isinstance(i, StepDone) for i in h.pending)
    out = h.step(kind("r"))  # the harness lists the pending StepDone first
    assert not _of(out, EmitTokens), "the step's token for r is discarded: the cancel came first"
    assert h.finishes["r"].reason == "cancelled" and h.finishes["r"].usage.completion_tokens == 1


def test_c03_c18_a_lone_head_discounts_its_hits_too() -> None:
    # Nothing runs; 12 blocks, 2 of them cached with the head's prefix, 10 free, 4 promised to a parked sequence.
    # With the watermark the head needs 9 - 2 hits = 7 > 6; alone, 8 - 2 = 6: it fits, its hits protected.
    core = make_core(num_blocks=12, block_size=16, max_seq_len=128, admit_watermark=16)
    state = core.state
    add_seq(state, "parked", 20, outputs=13, status=Status.PREEMPTED)
    template = Seq("t", 99, 0, [100 + i for i in range(127)], SamplingSpec(max_tokens=100), 0, None, "")
    own = cache_prefix_of(state, template, 32)
    out = _tick(core, arrival("head", template.prompt, 100))
    assert _bound(out) == ["head"]
    head = _snap_seq(core.snapshot(), "head")
    assert head.reserve == 8 and head.block_ids[:2] == own


# -- The executor's side: BindRequest once at admission, ReleaseRequest once at the end ---------------------------


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_bind_request_carries_the_masked_ids_and_the_prompt(ignore_eos: bool) -> None:
    core = make_core(num_blocks=16, max_seq_len=128, eos_token_ids=(2, 3))
    params = SamplingSpec(max_tokens=4, min_tokens=2, stop_token_ids=[3, 9], ignore_eos=ignore_eos)
    out = _tick(core, arrival("r", [10, 11, 12], params=params, seed=5))
    masked = [3, 9] if ignore_eos else [2, 3, 9]  # EOS ids unless ignored, then the stop ids not among them
    assert _of(out, BindRequest) == [BindRequest("r", params, 5, 3, masked, [10, 11, 12])]


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
    [step] = _of(_tick(core, arrival("r", 10, 4)), RunStep)
    core.state.seqs["r"].outputs.append(5)  # the core's record no longer matches the step it planned
    with pytest.raises(InvariantViolation) as raised:
        _tick(core, StepDone(step.step_id, ["r"], [7], logprobs=[-0.5]))
    assert raised.value.invariant == "step results match their step"
    assert raised.value.detail == f"step {step.step_id} sampled output 0 of 'r', which has 1 outputs"


# -- C25: shutdown names the state of every parked request ------------------------------------------------------


def test_c25_shutdown_names_a_request_whose_spill_is_in_progress() -> None:
    core = make_core(num_blocks=16, max_seq_len=128, spill_enabled=True)
    seq = add_seq(core.state, "s", 20, outputs=5, status=Status.SWAPPING)
    seq.spill_tokens, seq.has_spill = 24, True
    out = _tick(core, Shutdown())
    [finish] = _of(out, Finish)
    assert (finish.reason, finish.error) == ("error", "engine shut down while swapped out")


def test_c14_c25_a_deadline_due_in_the_shutdown_tick_wins_as_timeout() -> None:
    h = Harness(CoreConfig(num_blocks=16, max_seq_len=128))
    h.step(arrival("r", 10, 50, deadline_ns=3 * TICK_NS))
    h.step()
    h.step()
    out = h.step(Shutdown())  # now_ns == deadline_ns: the sweep times r out at the token shutdown ends it at
    [finish] = _of(out, Finish)
    assert (finish.request_id, finish.reason) == ("r", "timeout"), "timeout > error at the same token"
    assert finish.usage.completion_tokens == len(h.tokens["r"]) == 3


# -- The invariant checker (ARCHITECTURE.md, Invariants): each corruption is caught and named --------------------


def _checked_core() -> SchedulerCore:
    """A valid state with something of every kind: two steps in flight, a fenced finished row, a waiting queue,
    a preempted and a swapped sequence, cached blocks."""
    h = Harness(CoreConfig(num_blocks=16, block_size=16, max_seq_len=64, max_batch_size=2, pipeline_depth=2),
                device_lag=5)
    h.step(arrival("a", 20, 8), arrival("b", 20, 8), arrival("c", 10, 4), arrival("d", 12, 4), arrival("e", 12, 4))
    h.step(RequestCancelled("b"))
    state = h.core.state
    assert [[seq.request_id for seq in step.seqs] for step in state.steps] == [["a", "b"], ["a", "c"]]
    assert [(step, rid) for step, rid, _ in state.fences] == [(0, "b")]
    add_seq(state, "p", 20, outputs=3, status=Status.PREEMPTED)
    swapped = add_seq(state, "s", 20, outputs=3, status=Status.SWAPPED)
    swapped.spill_tokens, swapped.has_spill = 22, True
    cache_unrelated(state, 2)
    h.core.check_invariants()
    return h.core


def _first_free(state: CoreState) -> int:
    return next(iter(state.pool.free))


def _last_free(state: CoreState) -> int:
    return next(reversed(state.pool.free))


def _twice(state: CoreState) -> str:
    a = state.seqs["a"]
    a.block_ids.append(a.block_ids[0])
    return f"block conservation: 'a' holds a block twice: {a.block_ids}"


def _lost(state: CoreState) -> str:
    del state.pool.free[_last_free(state)]
    return "block conservation: free 8 + cached 2 + in use 5 != total 16"


def _refcount(state: CoreState) -> str:
    block = state.seqs["a"].block_ids[1]
    state.pool.ref[block] += 1
    return f"block conservation: block {block} has refcount 2 but 1 holders ['a']"


def _fence_holds(state: CoreState) -> str:
    [(_, _, blocks)] = state.fences
    state.pool.ref[blocks[0]] += 1
    return f"block conservation: block {blocks[0]} has refcount 2 but 1 holders []"


def _in_use_and(where: str) -> Callable[[CoreState], str]:
    def corrupt(state: CoreState) -> str:
        block = state.seqs["a"].block_ids[0]
        del state.pool.free[_last_free(state)]
        getattr(state.pool, where)[block] = None
        if where == "cached":
            state.pool.hash_of[block] = b"h" * 16
            state.pool.by_hash[b"h" * 16] = block
        return f"block conservation: block {block} is in use and also free"
    return corrupt


def _free_and_cached(state: CoreState) -> str:
    block = _first_free(state)
    del state.pool.free[_last_free(state)]
    state.pool.cached[block] = None
    return f"block conservation: unreferenced block {block} must be free or cached"


def _free_with_hash(state: CoreState) -> str:
    block = _first_free(state)
    state.pool.hash_of[block] = b"h" * 16
    state.pool.by_hash[b"h" * 16] = block
    return f"prefix cache: free block {block} still has a hash"


def _cached_without_hash(state: CoreState) -> str:
    block = _last_free(state)
    del state.pool.free[block]
    state.pool.cached[block] = None
    return f"prefix cache: cached block {block} has no hash"


def _index_names_another(state: CoreState) -> str:
    block = state.seqs["a"].block_ids[0]
    state.pool.by_hash[b"h" * 16] = block
    return f"prefix cache: hash index names block {block}, which has another hash"


def _index_misses(state: CoreState) -> str:
    state.pool.hash_of[state.seqs["a"].block_ids[1]] = b"h" * 16
    return "prefix cache: hash index and block hashes disagree"


def _parked_while_referenced(status: Status) -> Callable[[CoreState], str]:
    def corrupt(state: CoreState) -> str:
        state.seqs["c"].status = status
        return "fences: 'c' was preempted while step 1 references it"
    return corrupt


def _unfenced(state: CoreState) -> str:
    [(_, _, blocks)] = state.fences
    state.fences.clear()
    state.pool.release(blocks)
    return "fences: finished 'b' is referenced by step 0 but not fenced"


def _fenced_too_early(state: CoreState) -> str:
    a = state.seqs["a"]
    del state.seqs["a"]
    state.pool.release(a.block_ids)
    state.running.remove(a)
    a.status = Status.FINISHED
    a.last_step = 0  # but step 1 references it too
    state.fences.append((0, "a", []))
    return "fences: finished 'a' is referenced by step 1 but not fenced"


def _settled_fence(state: CoreState) -> str:
    state.fences.append((-1, "x", []))
    return "fences: a fence for settled step -1 still holds blocks"


def _wrong_queue(state: CoreState) -> str:
    state.preempted.append(state.seqs["a"])
    return "queues: 'a' (RUNNING) is in preempted"


def _not_the_live_one(state: CoreState) -> str:
    p = state.seqs["p"]
    state.seqs["p"] = add_seq(state, "p", 20, outputs=3, status=Status.PREEMPTED)
    state.preempted.remove(p)
    state.preempted.remove(state.seqs["p"])
    state.preempted.append(p)
    return "queues: 'p' (PREEMPTED) is in preempted"


def _waiting_count(state: CoreState) -> str:
    state.waiting._dead += 1
    return "queues: the waiting queue counts 1 but holds 2"


def _waiting_order(state: CoreState) -> str:
    waiting = state.waiting
    waiting._items[waiting._head :] = waiting._items[waiting._head :][::-1]
    return "queues: the waiting queue is out of (priority, arrival) order"


def _queued_twice(state: CoreState) -> str:
    state.swapped.append(state.seqs["s"])
    return "queues: 's' (SWAPPED) is not queued once"


def _not_queued(state: CoreState) -> str:
    add_seq(state, "lost", 10, status=Status.WAITING)
    return "queues: 'lost' (WAITING) is not queued once"


def _unretired(state: CoreState) -> str:
    state.finishing.append(state.seqs["a"])
    return "endings: finished requests were left unretired at the end of a tick"


def _over_batch(state: CoreState) -> str:
    add_seq(state, "third", 10)
    return "bounds: 3 active sequences > max_batch_size=2"


def _over_seq_len(state: CoreState) -> str:
    p = state.seqs["p"]
    p.outputs += [7] * (64 - p.num_tokens + 1)
    p.params = SamplingSpec(max_tokens=100)
    return "bounds: 'p' holds 65 > max_seq_len"


def _over_max_tokens(state: CoreState) -> str:
    state.seqs["p"].params = SamplingSpec(max_tokens=2)
    return "bounds: 'p' has 3 > max_tokens outputs"


def _inflight(n: int) -> Callable[[CoreState], str]:
    def corrupt(state: CoreState) -> str:
        state.seqs["p"].inflight = n
        return f"fences: 'p' has {n} tokens in flight"
    return corrupt


CORRUPTIONS: dict[str, Callable[[CoreState], str]] = {
    "block held twice": _twice,
    "block lost": _lost,
    "refcount above holders": _refcount,
    "fence holds a block": _fence_holds,
    "in use and free": _in_use_and("free"),
    "in use and cached": _in_use_and("cached"),
    "free and cached": _free_and_cached,
    "free with a hash": _free_with_hash,
    "cached without a hash": _cached_without_hash,
    "hash index names another block": _index_names_another,
    "hash index misses a block": _index_misses,
    "preempted while referenced": _parked_while_referenced(Status.PREEMPTED),
    "swapping while referenced": _parked_while_referenced(Status.SWAPPING),
    "swapped while referenced": _parked_while_referenced(Status.SWAPPED),
    "finished and not fenced": _unfenced,
    "fenced before its newest step": _fenced_too_early,
    "fence of a settled step": _settled_fence,
    "in the wrong queue": _wrong_queue,
    "queued but not live": _not_the_live_one,
    "waiting count": _waiting_count,
    "waiting order": _waiting_order,
    "queued twice": _queued_twice,
    "not queued": _not_queued,
    "left unretired": _unretired,
    "batch too big": _over_batch,
    "past max_seq_len": _over_seq_len,
    "past max_tokens": _over_max_tokens,
    "negative in flight": _inflight(-1),
    "too many in flight": _inflight(3),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_invariants_a_corrupted_state_is_named(corruption: str) -> None:
    core = _checked_core()
    message = CORRUPTIONS[corruption](core.state)
    with pytest.raises(InvariantViolation) as raised:
        core.check_invariants()
    assert str(raised.value) == message


def test_invariants_hold_at_every_bound() -> None:
    core = _checked_core()
    state = core.state
    p = state.seqs["p"]
    p.params = SamplingSpec(max_tokens=64 - 20)
    p.outputs += [7] * (64 - p.num_tokens)  # prompt + outputs == max_seq_len, outputs == max_tokens
    p.inflight = 2  # == pipeline_depth
    core.check_invariants()


def _laned_core() -> SchedulerCore:
    """Two sequences decoding in the steady state, planned by the decode lane."""
    h = Harness(CoreConfig(num_blocks=16, block_size=16, max_seq_len=64, max_batch_size=2))
    h.step(arrival("a", 10, 20), arrival("b", 12, 20))
    for _ in range(3):
        h.step()
    lane = h.core.state.lane
    assert lane is not None and [seq.request_id for seq in lane.seqs] == ["a", "b"]
    h.core.check_invariants()
    return h.core


def _lane_member(state: CoreState, request_id: str) -> str:
    assert state.lane is not None
    seq = state.seqs[request_id]
    i = state.lane.seqs.index(seq)
    found = (state.lane.positions[i], state.lane.indices[i], state.lane.sent[i])
    expected = (seq.num_computed, len(seq.outputs) + seq.inflight, seq.sent_blocks)
    return (f"decode lane: {request_id!r}: lane (position, index, sent) {found} but the sequence has {expected}, "
            f"last step {seq.last_step} (lane step {state.lane.step_id}), {len(seq.block_ids)} blocks")


def _with_tokens(state: CoreState) -> DecodeLane:
    lane = state.lane
    assert lane is not None
    lane.tokens_step = lane.step_id
    lane.tokens = [seq.outputs[-1] for seq in lane.seqs]
    return lane


def _lane_column(state: CoreState) -> str:
    assert state.lane is not None
    state.lane.indices.append(0)
    return "decode lane: columns of lengths [2, 3, 2] for 2 members"


def _lane_order(state: CoreState) -> str:
    lane = state.lane
    assert lane is not None
    for column in (lane.seqs, lane.positions, lane.indices, lane.sent):
        column.reverse()
    return "decode lane: members out of running order"


def _lane_token_count(state: CoreState) -> str:
    _with_tokens(state).tokens.pop()
    return "decode lane: 1 tokens for 2 members"


def _lane_field(field: str) -> Callable[[CoreState], str]:
    def corrupt(state: CoreState) -> str:
        lane = state.lane
        assert lane is not None
        getattr(lane, field)[1] += 1
        return _lane_member(state, "b")
    return corrupt


def _lane_last_step(state: CoreState) -> str:
    state.seqs["b"].last_step -= 1
    return _lane_member(state, "b")


def _lane_partial_table(state: CoreState) -> str:
    lane = state.lane
    assert lane is not None
    state.seqs["b"].sent_blocks -= 1
    lane.sent[1] -= 1
    return _lane_member(state, "b")


def _lane_token(state: CoreState) -> str:
    lane = _with_tokens(state)
    lane.tokens[1] += 1
    return f"decode lane: 'b': pending token {state.seqs['b'].outputs[-1]}, lane holds {lane.tokens[1]}"


def _lane_forgets(state: CoreState) -> str:
    lane = state.lane
    assert lane is not None
    for column in (lane.seqs, lane.positions, lane.indices, lane.sent):
        column.pop()
    return "decode lane: running 'b' is neither a member, prefilling, joining nor left out"


LANE_CORRUPTIONS: dict[str, Callable[[CoreState], str]] = {
    "column length": _lane_column,
    "running order": _lane_order,
    "token count": _lane_token_count,
    "position": _lane_field("positions"),
    "index": _lane_field("indices"),
    "sent blocks": _lane_field("sent"),
    "last step": _lane_last_step,
    "partly sent table": _lane_partial_table,
    "pending token": _lane_token,
    "a running sequence missing": _lane_forgets,
}


@pytest.mark.parametrize("corruption", list(LANE_CORRUPTIONS))
def test_invariants_a_corrupted_decode_lane_is_named(corruption: str) -> None:
    core = _laned_core()
    message = LANE_CORRUPTIONS[corruption](core.state)
    with pytest.raises(InvariantViolation) as raised:
        core.check_invariants()
    assert str(raised.value) == message


def test_invariants_a_lane_holding_the_settled_tokens_is_valid() -> None:
    core = _laned_core()
    _with_tokens(core.state)
    core.check_invariants()


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
    parked = _snap_seq(snap, "r1")
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
    _tick(core, arrival("r", prompt, 10), arrival("c", 10, 10))
    [step1] = _of(_tick(core, arrival("q", prompt, 10), arrival("z", 10, 10), RequestCancelled("c")), RunStep)
    assert step1.request_ids == ["r", "q", "z"] and step1.fed_from == [0, -1, -1], "q hits r's 2 blocks"
    assert [(step, rid) for step, rid, _ in core.snapshot().fences] == [(0, "c")]
    out = _tick(core, StepFailed(0, "boom"))
    finishes = {c.request_id: c for c in _of(out, Finish)}
    assert list(finishes) == ["r", "q"], "r's row failed, and q shares the blocks it registered; z does not"
    assert {f.reason for f in finishes.values()} == {"error"}
    assert {f.error for f in finishes.values()} == {"step 0 failed: boom"}
    snap = core.snapshot()
    assert all(h is None for h in snap.pool.hash_of), "the blocks step 0 registered left the prefix cache"
    assert [(step, rid) for step, rid, _ in snap.fences] == [(1, "r"), (1, "q")], "c's fence went with step 0"
    [z] = [seq for seq in snap.seqs[: snap.live]]
    assert z.request_id == "z" and z.status is Status.RUNNING
    out = _tick(core, StepDone(1, ["r", "q", "z"], [7, 8, 9]))
    assert [(c.request_ids, c.token_ids) for c in _of(out, EmitTokens)] == [(["z"], [9])], "r and q are discarded"
    assert core.snapshot().fences == []


def test_a_failed_step_fails_the_rows_fed_from_it() -> None:
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128, pipeline_depth=2, prefix_caching=False)
    _tick(core, arrival("r", 20, 10))
    [step1] = _of(_tick(core), RunStep)
    assert step1.request_ids == ["r"] and step1.fed_from == [0], "running ahead: step 1 is fed from step 0"
    out = _tick(core, StepFailed(0, "device lost"))
    assert _of(out, Finish) == [Finish("r", "error", Usage(20, 0, 0), "step 0 failed: device lost")]
    out = _tick(core, StepFailed(1, "device lost"))
    assert not _of(out, Finish), "r ended once"
    snap = core.snapshot()
    assert snap.live == 0 and snap.fences == [] and len(snap.pool.free) == 16


def test_c14_a_deadline_due_when_a_step_fails_ends_its_rows_as_timeout() -> None:
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128, pipeline_depth=2)
    prompt = list(range(100, 140))
    _tick(core, arrival("r", prompt, 10, deadline_ns=5))
    _tick(core, arrival("q", prompt, 10, deadline_ns=5))  # q shares the 2 blocks step 0 registers
    out = core.tick(TickInputs(3, 5, [StepFailed(0, "boom")]))
    reasons = {c.request_id: c.reason for c in _of(out, Finish)}
    assert reasons == {"r": "timeout", "q": "timeout"}, "timeout > error at the same token"


# -- C14: a stop match names a delivered token --------------------------------------------------------------------


def _decoding(outputs: int) -> SchedulerCore:
    core = make_core(num_blocks=16, max_seq_len=128)
    hold_blocks(core.state, add_seq(core.state, "r", 20, outputs=outputs), 2)
    return core


def test_c14_a_stop_match_at_the_first_token_truncates_to_it() -> None:
    core = _decoding(3)
    out = _tick(core, StopMatched("r", 0))
    [finish] = _of(out, Finish)
    assert (finish.reason, finish.usage.completion_tokens) == ("stop", 1)


@pytest.mark.parametrize("index", [-1, 3])
def test_c14_a_stop_match_past_the_delivered_tokens_is_refused(index: int) -> None:
    core = _decoding(3)
    with pytest.raises(InvariantViolation) as raised:
        _tick(core, StopMatched("r", index))
    assert str(raised.value) == (
        f"stop matches name delivered tokens: 'r' has 3 outputs; a stop string matched at {index}"
    )


def test_c14_a_stop_match_for_an_unknown_request_is_ignored() -> None:
    core = _decoding(3)
    out = _tick(core, StopMatched("gone", 5))
    assert not _of(out, Finish)


def test_c14_a_stop_match_then_a_deadline_in_the_same_tick_meet_at_the_truncated_token() -> None:
    # The stop match (applied with the inputs) truncates to index 1; the deadline sweep then times the request out
    # at its last token, now index 1 too, where timeout takes precedence over stop.
    core = _decoding(3)
    seq = core.state.seqs["r"]
    seq.deadline_ns = 0
    core.state.deadlines.append((0, seq.arrival, "r"))
    out = _tick(core, StopMatched("r", 1))
    [finish] = _of(out, Finish)
    assert (finish.reason, finish.usage.completion_tokens) == ("timeout", 2)


# -- Inputs that contradict what the core knows are refused, naming the rule ------------------------------------


def _refused(core: SchedulerCore, tick: TickInputs) -> str:
    with pytest.raises(InvariantViolation) as raised:
        core.tick(tick)
    return str(raised.value)


def _one_step() -> tuple[SchedulerCore, RunStep]:
    core = make_core(num_blocks=16, max_seq_len=128)
    [step] = _of(_tick(core, arrival("r", 10, 4)), RunStep)
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
    [emit] = _of(out, EmitTokens)
    assert (emit.request_ids, emit.token_ids, emit.token_indices, emit.reasoning) == (["r"], [THINK_END], [0], [True])
    [prefill] = _of(out, RunStep)
    assert prefill.sample_indices == [NO_SAMPLE], "the prefill samples nothing: output 0 is known"
    h.run()
    assert h.output("r")[0] == THINK_END and THINK_END not in h.output("r")[1:]
    assert h.finishes["r"].usage.reasoning_tokens == 1 and len(h.output("r")) == 4


def test_c12_a_deadline_notice_for_another_deadline_is_ignored() -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    _tick(core, arrival("r", 10, 4, deadline_ns=10**12))
    assert not _of(_tick(core, DeadlineReached("r", 10**12 - 1)), Finish), "a notice for a deadline r does not have"
    [finish] = _of(_tick(core, DeadlineReached("r", 10**12)), Finish)
    assert finish.reason == "timeout"


def test_c10_swap_in_failed_ends_a_swapped_request_and_is_ignored_after() -> None:
    core = make_core(num_blocks=16, max_seq_len=128, spill_enabled=True)
    swapped = add_seq(core.state, "s", 20, outputs=5, status=Status.SWAPPED)
    swapped.spill_tokens, swapped.has_spill = 24, True
    out = _tick(core, SwapInFailed("s", "checksum mismatch"))
    assert _of(out, Finish) == [Finish("s", "error", Usage(20, 0, 5), "swap-in failed: checksum mismatch")]
    assert DropSpill("s") in out.commands
    assert not _tick(core, SwapInFailed("s", "again")).commands, "a late report for an ended request is ignored"


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
    out = _tick(core, RequestCancelled("r"), StopMatched("r", 2))
    [finish] = _of(out, Finish)
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
    out = _tick(core, RequestCancelled("x"), ClientGone("x"), SpillDone("x", False, "e"), SwapInReady("x"),
                SwapInFailed("x", "e"), StopMatched("x", 0), DeadlineReached("x", 5))
    assert out.commands == [] and not out.needs_tick


def test_c12_an_arrival_with_a_deadline_asks_for_a_wake_up() -> None:
    core = make_core(num_blocks=16, max_seq_len=128)
    out = _tick(core, arrival("r", 10, 4, deadline_ns=5_000), arrival("s", 10, 4))
    assert _of(out, WatchDeadline) == [WatchDeadline("r", 5_000)], "only a request with a deadline is watched"


def test_logprobs_stay_aligned_when_two_steps_settle_in_one_tick_and_only_the_first_has_them() -> None:
    core = make_core(num_blocks=16, max_seq_len=128, pipeline_depth=2)
    _tick(core, arrival("r", 10, 8))
    [step1] = _of(_tick(core), RunStep)
    assert step1.fed_from == [0]
    out = _tick(core, StepDone(0, ["r"], [7], logprobs=[-0.5]), StepDone(1, ["r"], [8]))
    [emit] = _of(out, EmitTokens)
    assert emit.request_ids == ["r", "r"] and emit.token_ids == [7, 8]
    assert emit.logprobs is not None and len(emit.logprobs) == 2
    assert emit.logprobs[0] == -0.5 and math.isnan(emit.logprobs[1]), "no logprob for the second: NaN in its place"


def test_c14_a_deadline_due_when_a_swap_in_fails_ends_it_as_timeout() -> None:
    core = make_core(num_blocks=16, max_seq_len=128, spill_enabled=True)
    swapped = add_seq(core.state, "s", 20, outputs=5, status=Status.SWAPPED)
    swapped.spill_tokens, swapped.has_spill, swapped.deadline_ns = 24, True, 0
    core.state.deadlines.append((0, swapped.arrival, "s"))
    [finish] = _of(_tick(core, SwapInFailed("s", "checksum mismatch")), Finish)
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
    out = _tick(core)
    assert _of(out, Preempted) == [Preempted("b", "requeue")]
    [step] = _of(out, RunStep)
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
    out = _tick(core)
    assert _of(out, Preempted) == [Preempted("b", "requeue")]
    [step] = _of(out, RunStep)
    assert step.request_ids == ["a", "c"]


@pytest.mark.parametrize("depth", [1, 2])
def test_c15_a_planned_step_asks_for_a_tick_only_while_the_pipeline_has_room(depth: int) -> None:
    core = make_core(num_blocks=16, max_seq_len=128, pipeline_depth=depth)
    out = _tick(core, arrival("r", 10, 8))
    assert _of(out, RunStep) and out.needs_tick is (depth == 2), "at depth 2 the next step is fed from this one"
    out = _tick(core)
    assert out.needs_tick is False, "the pipeline is full (or, at depth 1, waits for the step)"
