"""C18–C21 and C25: the prefix cache, caching at retirement, the thinking budget, leaks, shutdown."""

from __future__ import annotations

from core_harness import Harness, arrival
from core_state import add_seq, cache_prefix_of, context, hold_blocks, make_core
from tests_shared import PROMPT_40

from tickloom.engine.core import CoreConfig
from tickloom.engine.core.blocks import ROOT_HASH, BlockPool, block_hash
from tickloom.engine.core.planner import plan_step
from tickloom.engine.core.preemption import preempt
from tickloom.engine.core.prefix_cache import full_block_hashes
from tickloom.engine.core.status import Status
from tickloom.events import (
    DropSpill,
    EmitTokens,
    Finish,
    Preempted,
    RequestCancelled,
    RunStep,
    SamplingSpec,
    Shutdown,
    TickInputs,
)


def _first_row(h: Harness, request_id: str) -> tuple[int, int]:
    step = next(c for _, c in h.commands(RunStep) if request_id in c.request_ids)
    i = step.request_ids.index(request_id)
    return step.positions[i], step.num_tokens[i]


def test_c18_only_full_blocks_are_cached() -> None:
    h = Harness(CoreConfig(num_blocks=16, max_seq_len=128))
    h.step(arrival("r", 30, 10))  # 40 tokens, KV for 39: two full blocks
    h.run()
    assert h.core.state.pool.num_cached == 2


def test_c18_hash_chain_is_stable_and_salted() -> None:
    a = block_hash(ROOT_HASH, list(range(16)), "")
    assert a == block_hash(ROOT_HASH, list(range(16)), "")
    assert a != block_hash(ROOT_HASH, list(range(16)), "tenant-b"), "the cache salt is part of the key"
    assert block_hash(a, list(range(16)), "") != a, "the parent is part of the key"
    assert len(a) == 16


def test_c18_hit_never_covers_the_last_prompt_token() -> None:
    h = Harness(CoreConfig(num_blocks=16, max_seq_len=128))
    prompt = list(range(100, 132))  # exactly two full blocks
    h.step(arrival("first", prompt, 1))
    h.run()
    h.step(arrival("again", prompt, 1))
    h.run()
    assert _first_row(h, "again") == (16, 16), "one block hit; the second is recomputed for the last token"
    assert h.finishes["again"].usage.cached_prompt_tokens == 16


def test_c18_different_salt_misses() -> None:
    h = Harness(CoreConfig(num_blocks=16, max_seq_len=128))
    h.step(arrival("a", PROMPT_40, 1, cache_salt="alice"))
    h.run()
    h.step(arrival("b", PROMPT_40, 1, cache_salt="bob"), arrival("c", PROMPT_40, 1, cache_salt="alice"))
    h.run()
    assert _first_row(h, "b") == (0, 40)
    assert _first_row(h, "c") == (32, 8)


def test_c18_identical_prompts_in_one_tick_share() -> None:
    h = Harness(CoreConfig(num_blocks=16, max_seq_len=128))
    h.step(arrival("one", PROMPT_40, 4), arrival("two", PROMPT_40, 4))
    step = next(c for _, c in h.commands(RunStep))
    assert step.request_ids == ["one", "two"]
    assert (step.positions, step.num_tokens) == ([0, 32], [40, 8]), "the second computes only the unshared part"
    h.run()
    assert h.finishes["two"].usage.cached_prompt_tokens == 32


def test_c18_eviction_order() -> None:
    pool = BlockPool.create(6)
    a = pool.allocate(3)
    for i, block in enumerate(a):
        pool.register(block, bytes([i]) * 16)
    pool.release(a)  # tail first: the last block is the least recently freed... and evicted first
    assert list(pool.cached) == [a[2], a[1], a[0]]
    assert pool.allocate(3) == [3, 4, 5], "free blocks with no hash are reused before any cached block"
    assert pool.num_free == 0
    pool.claim([a[1]])  # a request hits a[1]: no longer evictable
    assert pool.reclaim(3) == 2 and list(pool.cached) == []
    assert pool.free and pool.hash_of[a[1]] is not None and pool.ref[a[1]] == 1


def test_c18_failed_allocation_leaves_hit_refcounts_unchanged() -> None:
    core = make_core(num_blocks=5, block_size=16, max_seq_len=64)
    state = core.state
    busy = add_seq(state, "busy", 40, outputs=1)
    hold_blocks(state, busy, 3)
    busy.last_step = 0  # an unsettled step references it: it cannot be a victim
    state.settled_step = -1
    fresh = add_seq(state, "fresh", 40)
    hits = cache_prefix_of(state, fresh, 32)
    assert state.pool.num_free == 0 and [state.pool.ref[b] for b in hits] == [0, 0]
    state.next_step_id = 1
    assert plan_step(state, context()) is not None  # plans busy's decode row only
    assert [state.pool.ref[b] for b in hits] == [0, 0] and set(hits) <= set(state.pool.cached)
    assert fresh.block_ids == [] and fresh.status is Status.PREEMPTED, "it was its own victim: requeued"


def test_c19_retirement_caches_prompt_and_output() -> None:
    h = Harness(CoreConfig(num_blocks=32, max_seq_len=128))
    h.step(arrival("r", 20, 20))
    h.run()
    history = arrival("r", 20).prompt_token_ids + h.output("r")
    h.step(arrival("follow", [*history, 5, 6, 7], 1))
    h.run()
    assert _first_row(h, "follow")[0] == 32, "blocks holding generated tokens were cached before release"


def test_c19_errored_sequence_is_not_cached() -> None:
    config = CoreConfig(num_blocks=16, max_seq_len=128)
    h = Harness(config)
    h.oracle.fail_steps = frozenset({0})
    h.step(arrival("r", PROMPT_40, 4))
    h.run()
    assert h.reason("r") == "error" and "step 0 failed" in h.finishes["r"].error
    assert h.core.state.pool.num_cached == 0, "blocks filled by a failed step leave the cache"


def test_c19_requeue_offers_kv_to_the_cache() -> None:
    core = make_core(num_blocks=16, block_size=16, max_seq_len=128)
    state = core.state
    victim = add_seq(state, "victim", 30, outputs=5)
    hold_blocks(state, victim, 3)
    preempt(state, context(), victim)
    hashes = full_block_hashes(state, victim, 34)
    assert victim.status is Status.PREEMPTED and len(hashes) == 2
    assert all(h in state.pool.by_hash for h in hashes) and state.pool.num_cached == 2


def _thinking_run(num_blocks: int, budget: int) -> Harness:
    config = CoreConfig(num_blocks=num_blocks, block_size=16, max_seq_len=64, think_start_token=5,
                        think_end_token=6)
    h = Harness(config)
    prompt = [*list(range(100, 113)), 5]  # the prompt opens a thinking section
    params = SamplingSpec(max_tokens=40, thinking_budget=budget)
    h.step(*(arrival(rid, prompt, params=params, seed=i) for i, rid in enumerate(["a", "b", "c"])))
    h.run()
    return h


def test_c20_thinking_budget_forces_think_end() -> None:
    h = _thinking_run(num_blocks=32, budget=3)
    for rid in "abc":
        out = h.output(rid)
        assert out[3] == 6 and 6 not in out[:3], "after 3 thinking tokens think-end is forced"
        assert h.reasoning[rid] == [True] * 4 + [False] * 36
        assert h.finishes[rid].usage.reasoning_tokens == 4 and len(out) == 40, "reasoning counts to max_tokens"
    rows = [(c.token_ids[c.request_ids.index("a")], c.sample_indices[c.request_ids.index("a")])
            for _, c in h.commands(RunStep) if "a" in c.request_ids]
    assert (6, 4) in rows, "think-end is fed as the next input; output 4 is sampled after it"


def test_c20_thinking_state_survives_requeue() -> None:
    calm, pressed = _thinking_run(32, 3), _thinking_run(6, 3)
    assert pressed.commands(Preempted), "the small pool forced requeues"
    for rid in "abc":
        assert pressed.output(rid) == calm.output(rid) and pressed.reasoning[rid] == calm.reasoning[rid]



def test_c20_a_thinking_budget_does_nothing_without_thinking_markers() -> None:
    """With no think-start/think-end configured nothing is reasoning, so a budget (even 0) forces nothing and does
    not keep the sequence from running ahead: the steps are the same as without a budget."""
    from tickloom.events import SamplingSpec

    plain, budgeted = (Harness(CoreConfig(num_blocks=16, block_size=16, max_seq_len=128, pipeline_depth=2),
                               device_lag=1) for _ in range(2))
    plain.step(arrival("r", 10, params=SamplingSpec(max_tokens=6)))
    budgeted.step(arrival("r", 10, params=SamplingSpec(max_tokens=6, thinking_budget=0)))
    for h in (plain, budgeted):
        h.run()
    assert budgeted.output("r") == plain.output("r") and len(plain.output("r")) == 6
    assert budgeted.finishes["r"].usage.reasoning_tokens == 0 and budgeted.reasoning["r"] == [False] * 6
    assert budgeted.commands(RunStep) == plain.commands(RunStep)

def test_c21_no_leaks_after_a_mixed_workload() -> None:
    config = CoreConfig(num_blocks=10, block_size=16, max_seq_len=96, spill_enabled=True, pipeline_depth=2,
                        eos_token_ids=(2,))
    h = Harness(config, device_lag=1, spill_fails={"s3"})
    h.oracle.fail_steps = frozenset({9})
    h.step(*(arrival(f"s{i}", 15 + 7 * i, 30) for i in range(6)))
    h.step(arrival("late", PROMPT_40, 10, deadline_ns=4_000_000), arrival("shared", PROMPT_40, 10))
    h.step(RequestCancelled("s1"))
    h.run()
    state = h.core.state
    assert len(h.finishes) == 8
    assert state.pool.num_free + state.pool.num_cached == config.num_blocks
    assert all(r == 0 for r in state.pool.ref)
    assert not (state.seqs or state.fences or state.steps or state.running or state.swapping_or_swapped
                or state.preempted)


def test_c25_shutdown_ends_everything_with_explicit_errors() -> None:
    core = make_core(num_blocks=10, block_size=16, max_seq_len=128, spill_enabled=True)
    state = core.state
    hold_blocks(state, add_seq(state, "active", 40, outputs=2), 3)
    waiting = add_seq(state, "waiting", 30, status=Status.WAITING)
    state.waiting.append(waiting)
    add_seq(state, "parked", 20, outputs=3, status=Status.PREEMPTED)
    add_seq(state, "swapped", 20, outputs=3, status=Status.SWAPPED).has_spill = True
    out = core.tick(TickInputs(1, 0, [Shutdown()]))
    errors = {c.request_id: (c.reason, c.error) for c in out.commands if isinstance(c, Finish)}
    assert errors == {
        "active": ("error", "engine shut down"),
        "waiting": ("error", "engine shut down while waiting"),
        "parked": ("error", "engine shut down while preempted (requeued for recompute)"),
        "swapped": ("error", "engine shut down while swapped out"),
    }
    assert DropSpill("swapped") in out.commands, "spill files are removed"
    assert not any(isinstance(c, RunStep | EmitTokens) for c in out.commands)
    assert state.pool.num_free + state.pool.num_cached == 10 and not state.seqs
    late = core.tick(TickInputs(2, 0, [arrival("late", 10)]))
    assert [(c.reason, c.error) for c in late.commands if isinstance(c, Finish)] == [
        ("error", "request rejected: the engine is shut down")
    ]
    assert not late.needs_tick
