"""One test per scheduling rule, each asserting the rule itself through the commands the core emits and its
snapshot, so that breaking that one rule fails that one test (C03, C06, C08, C10, C14, C16, C18, C20).

The states are hand-built (``core_state``) where a scenario needs a precise pool layout, and driven through
``SchedulerCore.tick`` so the rule is observed as the core's clients observe it.
"""

from __future__ import annotations

import msgspec
import pytest
from core_harness import Harness, arrival
from core_state import (
    THINK_END,
    THINK_START,
    add_seq,
    bound,
    cache_unrelated,
    commands_of,
    context,
    hold_blocks,
    make_core,
    snap_seq,
    tick,
)

from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.engine.core.blocks import BlockPool
from tickloom.engine.core.preemption import choose_victim, preempt
from tickloom.engine.core.snapshot import CoreSnapshot
from tickloom.engine.core.status import Status
from tickloom.events import (
    EmitTokens,
    Finish,
    Preempted,
    RequestCancelled,
    RunStep,
    SamplingSpec,
    SpillOut,
    StepDone,
    SwapIn,
    SwapInReady,
)
from tickloom.replay.oracle import OracleExecutor

EOS = 2


def _running_ids(snap: CoreSnapshot) -> list[str]:
    return [snap.seqs[i].request_id for i in snap.running if snap.seqs[i].status is Status.RUNNING]


# -- C03: the admission gate -----------------------------------------------------------------------------------


def _gate(free: int, **config: object) -> SchedulerCore:
    """A core whose pool has exactly ``free`` free blocks, the rest held by a decoding ``holder``."""
    core = make_core(num_blocks=20, block_size=16, max_seq_len=128, **config)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 40, outputs=1), 20 - free)
    return core


@pytest.mark.parametrize("parked", [False, True])
def test_c03_preempted_sequences_count_in_admission_demand(parked: bool) -> None:
    core = _gate(free=10)
    if parked:
        # A 32-token history: resume_blocks = 3, and it resumes only with need + 1 = 4 blocks, all promised.
        add_seq(core.state, "parked", 20, outputs=13, status=Status.PREEMPTED)
    out = tick(core, arrival("head", 100, 8))  # blocks(100) = 7 blocks
    if not parked:
        assert bound(out) == ["head"], "7 of 10 free blocks: it fits"
        return
    assert bound(out) == [], "10 free - 4 promised to the parked sequence < 7: the head waits"
    snap = core.snapshot()
    assert [snap.seqs[i].request_id for i in snap.waiting] == ["head"]
    assert snap_seq(snap, "parked").status is Status.RUNNING, "the parked one resumed at the end of the tick"


def test_c03_swapped_sequences_do_not_count_in_admission_demand() -> None:
    core = _gate(free=10, spill_enabled=True)
    swapped = add_seq(core.state, "swapped", 60, outputs=13, status=Status.SWAPPED)
    swapped.spill_tokens, swapped.has_spill = 72, True  # not ready: it comes back only through swap-in
    out = tick(core, arrival("head", 100, 8))
    assert bound(out) == ["head"]
    assert not commands_of(out, SwapIn)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "admitted"),
    [
        (31, 100, True),  # 31 + 16 = 47 tokens: 3 blocks
        (32, 100, False),  # 32 + 16 = 48 tokens, exactly at a block boundary: 48 // 16 + 1 = 4 blocks
        (32, 15, True),  # the watermark is capped by max_tokens: 32 + 15 = 47 tokens, 3 blocks
    ],
)
def test_c03_watermark_at_a_block_boundary(prompt: int, max_tokens: int, admitted: bool) -> None:
    core = _gate(free=3, admit_watermark=16)
    out = tick(core, arrival("head", prompt, max_tokens))
    assert (bound(out) == ["head"]) is admitted
    if admitted:
        assert snap_seq(core.snapshot(), "head").reserve == 3


def test_c03_watermark_zero_reserves_the_prompt_only_at_the_boundary() -> None:
    # A 47-token prompt with watermark 0 reserves blocks(47) = 3; a 48-token one blocks(48) = 4.
    for prompt, admitted in ((47, True), (48, False)):
        core = _gate(free=3, admit_watermark=0)
        out = tick(core, arrival("head", prompt, 100))
        assert (bound(out) == ["head"]) is admitted, prompt


def _swap_gate(small_immune: bool) -> SchedulerCore:
    """Spill on, 6 free blocks; ``big`` (5 blocks) is immune, ``small`` (3 blocks) maybe; both settled, decoding."""
    core = make_core(num_blocks=14, block_size=16, max_seq_len=128, spill_enabled=True)
    state = core.state
    big = add_seq(state, "big", 60, outputs=5)
    hold_blocks(state, big, 5)
    big.immune_until = 5 + 64  # just resumed
    small = add_seq(state, "small", 30, outputs=3)
    hold_blocks(state, small, 3)
    if small_immune:
        small.immune_until = 3 + 64
    return core


def test_c03_c06_admission_swaps_out_only_non_immune_sequences() -> None:
    core = _swap_gate(small_immune=False)
    out = tick(core, arrival("head", 100, 4))  # 7 blocks, 6 free: short by 1
    swapped_out = [c.request_id for c in commands_of(out, SpillOut)]
    assert swapped_out == ["small"], "the immune one holds more blocks, yet stays"
    assert Preempted("small", "swap") in out.commands
    assert bound(out) == ["head"]
    snap = core.snapshot()
    assert snap_seq(snap, "big").status is Status.RUNNING
    assert snap_seq(snap, "small").status is Status.SWAPPING


def test_c03_c06_admission_never_swaps_out_an_immune_sequence() -> None:
    core = _swap_gate(small_immune=True)
    out = tick(core, arrival("head", 100, 4))
    assert not commands_of(out, SpillOut) and not commands_of(out, Preempted), (
        "unlike a victim choice, no fallback to immune ones")
    assert bound(out) == []
    assert _running_ids(core.snapshot()) == ["big", "small"]


def test_c03_admission_swaps_out_the_one_holding_the_most_blocks() -> None:
    core = _swap_gate(small_immune=False)
    core.state.seqs["big"].immune_until = -1
    out = tick(core, arrival("head", 100, 4))
    assert [c.request_id for c in commands_of(out, SpillOut)] == ["big"]
    assert bound(out) == ["head"]


def test_c03_admission_swaps_out_only_settled_decoding_sequences() -> None:
    core = _swap_gate(small_immune=False)
    state = core.state
    state.seqs["big"].immune_until = -1
    state.seqs["big"].last_step = 0  # an unsettled step references it
    state.next_step_id = 1
    out = tick(core, arrival("head", 100, 4))
    assert [c.request_id for c in commands_of(out, SpillOut)] == ["small"]


# -- C06: immunity after swap-in -------------------------------------------------------------------------------


def test_c06_immunity_re_armed_after_swap_in() -> None:
    config = dict(num_blocks=5, block_size=16, max_seq_len=64, spill_enabled=True, preempt_immunity_tokens=64)
    core = make_core(**config)
    state = core.state
    other = add_seq(state, "other", 40, outputs=8)  # pending token at position 47: 3 blocks suffice this tick
    hold_blocks(state, other, 3)
    back = add_seq(state, "back", 20, outputs=5, status=Status.SWAPPED)
    back.spill_tokens, back.swap_ready, back.has_spill = 24, True, True
    back.immune_until = -1  # whatever it was when it was swapped out
    out = tick(core)
    assert [(c.request_id, c.block_ids) for c in commands_of(out, SwapIn)] == [("back", [3, 4])]
    resumed = snap_seq(core.snapshot(), "back")
    assert resumed.immune_until == 5 + 64 and resumed.status is Status.RUNNING
    assert not resumed.swap_ready, "its readiness was used up: a later swap-out waits for a new SwapInReady"
    [step] = commands_of(out, RunStep)
    assert step.request_ids == ["other"]
    # Next tick: other needs a fourth block and none is free. ``back`` has the fewest tokens, but it is immune.
    out = tick(core, StepDone(step.step_id, ["other"], [700]))
    assert [c for c in out.commands if isinstance(c, Preempted)] == [Preempted("other", "swap")]
    assert _running_ids(core.snapshot()) == ["back"]


# -- C08: resuming several parked sequences -------------------------------------------------------------------


def test_c08_parked_sequences_resume_fewest_blocks_first() -> None:
    core = make_core(num_blocks=20, block_size=16, max_seq_len=128)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 100, outputs=1), 12)  # 8 free
    # Arrival order a, b, c, d. Resume needs (blocks of the history): a 4, b 2, c 3, d 2.
    add_seq(state, "a", 40, outputs=9, status=Status.PREEMPTED)  # history 48: 4 blocks, wants 5
    add_seq(state, "b", 10, outputs=7, status=Status.PREEMPTED)  # history 16: 2 blocks, wants 3
    add_seq(state, "c", 30, outputs=3, status=Status.PREEMPTED)  # history 32: 3 blocks, wants 4
    add_seq(state, "d", 12, outputs=5, status=Status.PREEMPTED)  # history 16: 2 blocks, wants 3
    out = tick(core)
    assert not any(isinstance(c, Preempted | Finish) for c in out.commands)
    snap = core.snapshot()
    # b (2) then d (2, arrived later) take 4 of 8; c wants 4 of the 4 left and takes 3; a wants 5 of 1: parked.
    assert _running_ids(snap) == ["holder", "b", "d", "c"]
    assert [snap.seqs[i].request_id for i in snap.preempted] == ["a"]
    assert [len(snap_seq(snap, r).block_ids) for r in "bdc"] == [2, 2, 3]
    assert len(snap.pool.free) == 1
    # The next step prefills them in that order.
    [holder_step] = commands_of(out, RunStep)
    [step] = commands_of(tick(core, StepDone(holder_step.step_id, ["holder"], [700])), RunStep)
    assert [r for r in step.request_ids if r != "holder"] == ["b", "d", "c"]


# -- C10: swap-in waits for SwapInReady ------------------------------------------------------------------------


def test_c10_swap_in_waits_for_swap_in_ready() -> None:
    config = CoreConfig(num_blocks=10, block_size=16, spill_enabled=True, max_batch_size=4, max_seq_len=128,
                        max_prefill_tokens=64)
    h = Harness(config, auto_swap_ready=False)
    h.step(arrival("r0", 20, 60), arrival("r1", 40, 8))
    h.step()
    h.step(arrival("r2", 100, 4))  # C23: admission swaps r1 out
    assert [c.request_id for _, c in h.commands(SpillOut)] == ["r1"]
    h.step()  # SpillDone(r1) arrives: the spill is in the store, but not yet back in the host tier
    while "r2" not in h.finishes:
        h.step()
    for _ in range(3):
        h.step()
    state = h.core.state
    assert state.pool.num_free + state.pool.num_cached >= 3, "there is room for r1 (reclaiming cached blocks)"
    assert not h.commands(SwapIn), "no SwapIn before SwapInReady"
    assert state.seqs["r1"].status is Status.SWAPPED
    out = h.step(SwapInReady("r1"))
    assert [c.request_id for c in commands_of(out, SwapIn)] == ["r1"], "swapped in at the tick SwapInReady arrives"
    h.run()
    assert h.reason("r1") == "length" and len(h.output("r1")) == 8


def test_c10_swap_in_ready_before_spill_done_waits_for_the_spill() -> None:
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128, spill_enabled=True)
    swapping = add_seq(core.state, "s", 20, outputs=5, status=Status.SWAPPING)
    swapping.spill_tokens, swapping.has_spill = 24, True
    out = tick(core, SwapInReady("s"))
    assert not commands_of(out, SwapIn), "the spill has not completed"
    assert snap_seq(core.snapshot(), "s").status is Status.SWAPPING


# -- C14: a stop at exactly min_tokens -------------------------------------------------------------------------


@pytest.mark.parametrize(("eos_at", "stops"), [(2, True), (1, False)])
def test_c14_stop_at_exactly_min_tokens(eos_at: int, stops: bool) -> None:
    config = CoreConfig(num_blocks=16, max_seq_len=128, eos_token_ids=(EOS,))
    oracle = OracleExecutor(config.vocab_size, avoid=(EOS,), scripted={"r": {eos_at: EOS}})
    h = Harness(config, oracle=oracle)
    h.step(arrival("r", 20, params=SamplingSpec(max_tokens=10, min_tokens=3)))
    h.run()
    if stops:
        assert h.reason("r") == "stop" and len(h.output("r")) == 3, "EOS as the third token, with min_tokens 3"
    else:
        assert h.reason("r") == "length" and len(h.output("r")) == 10, "EOS as the second token is masked"


def test_c14_stop_token_at_exactly_min_tokens_on_the_slow_path() -> None:
    config = CoreConfig(num_blocks=16, max_seq_len=128, think_start_token=THINK_START, think_end_token=THINK_END)
    oracle = OracleExecutor(config.vocab_size, avoid=(THINK_START, THINK_END), scripted={"r": {1: 77, 2: 77}})
    h = Harness(config, oracle=oracle)
    h.step(arrival("r", 20, params=SamplingSpec(max_tokens=10, min_tokens=3, stop_token_ids=[77])))
    h.run()
    assert h.reason("r") == "stop" and h.output("r")[1:] == [77, 77]


# -- C18: the order in which reclaim evicts --------------------------------------------------------------------


def _cached_pool(n: int) -> tuple[BlockPool, list[int]]:
    """A pool whose cache holds ``n`` blocks, freed in the order returned (least recently used first)."""
    pool = BlockPool.create(n + 2)
    blocks = pool.allocate(n)
    for block in blocks:
        pool.register(block, bytes([block]) * 16)
    for block in reversed(blocks):  # one table each, freed one at a time: LRU order is this order
        pool.release([block])
    return pool, list(reversed(blocks))


def test_c18_reclaim_evicts_least_recently_used_first() -> None:
    pool, lru = _cached_pool(5)
    assert list(pool.cached) == lru
    before_free = list(pool.free)
    assert pool.reclaim(2) == 2
    assert list(pool.cached) == lru[2:]
    assert list(pool.free) == before_free + lru[:2], "evicted blocks join the free list in eviction order"
    assert all(pool.hash_of[b] is None for b in lru[:2]) and all(pool.hash_of[b] is not None for b in lru[2:])
    assert pool.lookup([bytes([lru[0]]) * 16]) == [] and pool.lookup([bytes([lru[2]]) * 16]) == [lru[2]]


def test_c18_reclaim_skips_protected_blocks_and_keeps_their_place() -> None:
    pool, lru = _cached_pool(5)
    assert pool.reclaim(2, protect=[lru[0], lru[2]]) == 2
    assert list(pool.cached) == [lru[0], lru[2], lru[4]], "protected blocks stay, in their LRU order"
    assert list(pool.free)[-2:] == [lru[1], lru[3]]
    assert pool.reclaim(5, protect=[lru[2]]) == 2, "all that could be freed"
    assert list(pool.cached) == [lru[2]]


def test_c18_a_hit_block_moves_to_the_back_of_the_lru_order() -> None:
    pool, lru = _cached_pool(3)
    pool.claim([lru[0]])
    pool.release([lru[0]])
    assert list(pool.cached) == [lru[1], lru[2], lru[0]]
    pool.reclaim(1)
    assert list(pool.cached) == [lru[2], lru[0]]


def test_c18_exhaustion_reuses_cached_blocks_in_lru_order() -> None:
    core = make_core(num_blocks=10, block_size=16, max_seq_len=128)
    state = core.state
    hold_blocks(state, add_seq(state, "holder", 60, outputs=1), 6)
    cache_unrelated(state, 4)  # cached in the order they were freed
    lru = list(state.pool.cached)
    assert state.pool.num_free == 0 and len(lru) == 4
    out = tick(core, arrival("new", 20, 4))  # blocks(20) = 2
    assert bound(out) == ["new"]
    [step] = commands_of(out, RunStep)
    i = step.request_ids.index("new")
    start = sum(step.num_new_blocks[:i])
    assert step.new_block_ids[start : start + step.num_new_blocks[i]] == lru[:2], "the two least recently used"
    assert list(core.snapshot().pool.cached) == lru[2:]


# -- C16 and C15: over-runs on the slow settle path ------------------------------------------------------------


class _LogprobOracle(OracleExecutor):
    """The oracle, reporting a logprob for every sampled token (this puts settling on its slow path)."""

    def run_step(self, step: RunStep) -> StepDone:  # type: ignore[override]
        done = super().run_step(step)
        assert isinstance(done, StepDone)
        return msgspec.structs.replace(done, logprobs=[-0.25] * len(done.token_ids))


def _slow_path_harness(path: str, script: dict[str, dict[int, int]]) -> Harness:
    if path == "thinking":
        config = CoreConfig(num_blocks=16, max_seq_len=128, eos_token_ids=(EOS,), pipeline_depth=2,
                            think_start_token=THINK_START, think_end_token=THINK_END)
        oracle = OracleExecutor(config.vocab_size, avoid=(EOS, THINK_START, THINK_END), scripted=script)
    else:
        config = CoreConfig(num_blocks=16, max_seq_len=128, eos_token_ids=(EOS,), pipeline_depth=2)
        oracle = _LogprobOracle(config.vocab_size, avoid=(EOS,), scripted=script)
    return Harness(config, oracle=oracle, device_lag=1)


def _no_emit_after_finish(h: Harness, request_id: str) -> None:
    """Nothing for ``request_id`` is streamed after its ``Finish``, in the same tick or later."""
    seen_finish = False
    for out in h.outputs:
        for c in out.commands:
            if isinstance(c, Finish) and c.request_id == request_id:
                seen_finish = True
            elif isinstance(c, EmitTokens) and request_id in c.request_ids:
                assert not seen_finish, f"tick {out.tick}: a token for {request_id} after its Finish"
    assert seen_finish


@pytest.mark.parametrize("path", ["thinking", "logprobs"])
def test_c16_slow_settle_path_discards_the_over_run(path: str) -> None:
    h = _slow_path_harness(path, {"r": {3: EOS}})
    h.check = True
    h.step(arrival("r", 20, 50), arrival("s", 20, 10))
    while "r" not in h.finishes:
        h.step()
    steps = [c for _, c in h.commands(RunStep) if "r" in c.request_ids]
    assert [s.sample_indices[s.request_ids.index("r")] for s in steps] == [0, 1, 2, 3, 4], "a row ran ahead of EOS"
    h.run()
    assert h.finishes["r"].reason == "stop" and h.finishes["r"].usage.completion_tokens == 4
    assert len(h.tokens["r"]) == 4, "the over-run token (index 4) is never streamed"
    _no_emit_after_finish(h, "r")
    assert h.reason("s") == "length" and len(h.tokens["s"]) == 10, "the other row still streams"
    if path == "logprobs":
        emitted = [c for _, c in h.commands(EmitTokens)]
        assert all(c.logprobs is not None and len(c.logprobs) == len(c.request_ids) for c in emitted)


@pytest.mark.parametrize("path", ["thinking", "logprobs"])
def test_c17_slow_settle_path_discards_rows_of_a_cancelled_request(path: str) -> None:
    h = _slow_path_harness(path, {})
    h.step(arrival("r", 20, 50), arrival("s", 20, 12))
    for _ in range(4):
        h.step()
    assert len(h.core.state.steps) == 2, "two steps in flight, both with a row for r"
    before = len(h.tokens["r"])
    h.step(RequestCancelled("r"))
    h.run()
    assert h.reason("r") == "cancelled" and len(h.tokens["r"]) == before
    _no_emit_after_finish(h, "r")
    assert len(h.tokens["s"]) == 12


# -- C20: thinking state across a swap ------------------------------------------------------------------------


def _thinking_swap_run(num_blocks: int) -> Harness:
    config = CoreConfig(num_blocks=num_blocks, block_size=16, max_seq_len=64, spill_enabled=True,
                        think_start_token=THINK_START, think_end_token=THINK_END)
    h = Harness(config)
    prompt = [*range(100, 113), THINK_START]  # 14 tokens; the prompt opens a thinking section
    params = SamplingSpec(max_tokens=40, thinking_budget=30)  # thinking lasts past the first swap
    h.step(*(arrival(rid, prompt, params=params, seed=i) for i, rid in enumerate(["a", "b", "c"])))
    h.run()
    return h


def test_c20_thinking_state_survives_a_swap() -> None:
    calm, pressed = _thinking_swap_run(32), _thinking_swap_run(6)
    spills = [(t, c.request_id) for t, c in pressed.commands(SpillOut)]
    assert spills and pressed.commands(SwapIn), "the small pool swapped sequences out and back in"
    t, rid = spills[0]
    streamed = sum(c.request_ids.count(rid) for t2, c in pressed.commands(EmitTokens) if t2 <= t)
    assert streamed < 30, f"{rid} was swapped out while thinking"
    assert any(t2 > t for t2, c in pressed.commands(SwapIn) if c.request_id == rid), "and swapped back in"
    for rid in "abc":
        out = pressed.output(rid)
        assert out == calm.output(rid) and pressed.reasoning[rid] == calm.reasoning[rid]
        assert out[30] == THINK_END and THINK_END not in out[:30], "the budget held across the swap"
        assert pressed.reasoning[rid] == [True] * 31 + [False] * 9
        assert pressed.finishes[rid].usage.reasoning_tokens == 31


# -- C06: where immunity ends ----------------------------------------------------------------------------------


def test_c06_immunity_ends_after_exactly_preempt_immunity_tokens() -> None:
    core = make_core(num_blocks=64, max_seq_len=256, preempt_immunity_tokens=64)
    state = core.state
    resumed = add_seq(state, "resumed", 10, outputs=2 + 63)
    resumed.immune_until = 2 + 64  # resumed with 2 outputs; 63 generated since
    add_seq(state, "other", 10, outputs=100)
    victim = choose_victim(state, 0)
    assert victim is not None and victim.request_id == "other", "63 tokens after resuming: still immune"
    resumed.outputs.append(1)
    victim = choose_victim(state, 0)
    assert victim is not None and victim.request_id == "resumed", "64 tokens after resuming: fewest outputs again"


@pytest.mark.parametrize(("since_resume", "swapped"), [(63, "other"), (64, "resumed")])
def test_c03_c06_admission_swap_out_immunity_boundary(since_resume: int, swapped: str) -> None:
    core = make_core(num_blocks=14, block_size=16, max_seq_len=128, spill_enabled=True, preempt_immunity_tokens=64)
    state = core.state
    resumed = add_seq(state, "resumed", 10, outputs=3 + since_resume)  # resumed with 3 outputs
    hold_blocks(state, resumed, 5)
    resumed.immune_until = 3 + 64
    hold_blocks(state, add_seq(state, "other", 30, outputs=3), 3)
    out = tick(core, arrival("head", 100, 4))  # 7 blocks, 6 free
    assert [c.request_id for c in commands_of(out, SpillOut)] == [swapped], "immune for exactly 64 tokens"


# -- C09: which victims are swapped, which requeued ------------------------------------------------------------


def test_c09_a_victim_still_re_prefilling_its_history_is_requeued_not_swapped() -> None:
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128, spill_enabled=True)
    state = core.state
    victim = add_seq(state, "v", 30, outputs=5)  # resumed after a requeue: 34 history tokens to re-prefill
    hold_blocks(state, victim, 3)
    victim.num_computed = victim.kv_settled = 16  # one chunk of its history is back
    ctx = context()
    preempt(state, ctx, victim)
    assert ctx.commands == [Preempted("v", "requeue")], "little KV to save: no SpillOut"
    snap = core.snapshot()
    parked = snap_seq(snap, "v")
    assert parked.status is Status.PREEMPTED and [snap.seqs[i].request_id for i in snap.preempted] == ["v"]
    assert (parked.num_computed, parked.kv_settled, parked.block_ids) == (0, 0, []), "its KV is dropped"
    assert len(snap.pool.free) == 16 - 1 and len(snap.pool.cached) == 1, "its one settled full block is cached"


def test_c09_a_decoding_victim_is_swapped_with_its_settled_kv() -> None:
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128, spill_enabled=True)
    state = core.state
    victim = add_seq(state, "v", 30, outputs=5)
    hold_blocks(state, victim, 3)
    blocks = list(victim.block_ids)
    ctx = context()
    preempt(state, ctx, victim)
    assert ctx.commands == [Preempted("v", "swap"), SpillOut("v", blocks, 34)]
    parked = snap_seq(core.snapshot(), "v")
    assert parked.status is Status.SWAPPING and parked.spill_tokens == 34 and not parked.swap_ready
    assert (parked.num_computed, parked.kv_settled, parked.block_ids) == (0, 0, [])


# -- C20: what counts as reasoning ----------------------------------------------------------------------------


def _thinking_config() -> CoreConfig:
    return CoreConfig(num_blocks=16, max_seq_len=128, think_start_token=THINK_START, think_end_token=THINK_END)


def test_c20_no_reasoning_without_think_markers() -> None:
    h = Harness(CoreConfig(num_blocks=16, max_seq_len=128))
    h.step(arrival("r", [*range(100, 110), THINK_START], 4))  # the id means nothing when no markers are set
    h.run()
    assert h.finishes["r"].usage.reasoning_tokens == 0 and h.reasoning["r"] == [False] * 4


def test_c20_a_prompt_that_closes_its_thinking_section_starts_outside_it() -> None:
    config = _thinking_config()
    h = Harness(config)
    h.step(arrival("r", [100, THINK_START, 101, 102, THINK_END, 103], 4))
    h.run()
    assert h.finishes["r"].usage.reasoning_tokens == 0 and h.reasoning["r"] == [False] * 4


def test_c20_thinking_opened_and_closed_by_the_model_counts_its_markers() -> None:
    config = _thinking_config()
    oracle = OracleExecutor(config.vocab_size, avoid=(THINK_START, THINK_END),
                            scripted={"r": {1: THINK_START, 3: THINK_END}})
    h = Harness(config, oracle=oracle)
    h.step(arrival("r", 20, 6))
    h.run()
    assert h.output("r")[1] == THINK_START and h.output("r")[3] == THINK_END
    assert h.reasoning["r"] == [False, True, True, True, False, False]
    assert h.finishes["r"].usage.reasoning_tokens == 3, "think-start, one thought, think-end"
