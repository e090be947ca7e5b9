"""The invariant checker (ARCHITECTURE.md, Invariants): each corruption of a core state is caught and named,
and states that sit exactly on a bound pass. Found by mutation testing of ``engine/core/invariants.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
from core_harness import Harness, arrival
from core_state import add_seq, cache_unrelated

from tickloom.engine.core import CoreConfig, InvariantViolation, SchedulerCore
from tickloom.engine.core.state import CoreState, DecodeLane
from tickloom.engine.core.status import Status
from tickloom.events import (
    RequestCancelled,
    SamplingSpec,
)

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


def _dropped_unfinished(state: CoreState) -> str:
    """A step row whose sequence the core no longer tracks must be fenced, whatever status it was left with."""
    message = _unfenced(state)
    next(seq for step in state.steps for seq in step.seqs if seq.request_id == "b").status = Status.RUNNING
    return message


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
    state.swapping_or_swapped.append(state.seqs["s"])
    return "queues: 's' (SWAPPED) is not queued once"


def _not_queued(state: CoreState) -> str:
    add_seq(state, "lost", 10, status=Status.WAITING)
    return "queues: 'lost' (WAITING) is not queued once"


def _unretired(state: CoreState) -> str:
    state.finishing.append(state.seqs["a"])
    return "endings: finished requests were left unretired at the end of a tick"


def _finished_not_retired(state: CoreState) -> str:
    """A request finished while waiting (its queue entry a tombstone) but still tracked after the tick."""
    e = state.seqs["e"]
    e.status = Status.FINISHED
    state.waiting.discard(e)
    return "endings: 'e' is FINISHED but was not retired"


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
    "dropped while running and not fenced": _dropped_unfinished,
    "fenced before its newest step": _fenced_too_early,
    "fence of a settled step": _settled_fence,
    "in the wrong queue": _wrong_queue,
    "queued but not live": _not_the_live_one,
    "waiting count": _waiting_count,
    "waiting order": _waiting_order,
    "queued twice": _queued_twice,
    "not queued": _not_queued,
    "left unretired": _unretired,
    "finished but still tracked": _finished_not_retired,
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
    found = (state.lane.positions[i], state.lane.sample_indices[i], state.lane.sent_blocks[i])
    expected = (seq.num_computed, len(seq.outputs) + seq.inflight, seq.sent_blocks)
    return (f"decode lane: {request_id!r}: lane (position, index, sent) {found} but the sequence has {expected}, "
            f"last step {seq.last_step} (lane step {state.lane.step_id}), {len(seq.block_ids)} blocks")


def _with_tokens(state: CoreState) -> DecodeLane:
    lane = state.lane
    assert lane is not None
    lane.token_ids_step = lane.step_id
    lane.token_ids = [seq.outputs[-1] for seq in lane.seqs]
    return lane


def _lane_column(state: CoreState) -> str:
    assert state.lane is not None
    state.lane.sample_indices.append(0)
    return "decode lane: columns of lengths [2, 3, 2] for 2 members"


def _lane_order(state: CoreState) -> str:
    lane = state.lane
    assert lane is not None
    for column in (lane.seqs, lane.positions, lane.sample_indices, lane.sent_blocks):
        column.reverse()
    return "decode lane: members out of running order"


def _lane_token_count(state: CoreState) -> str:
    _with_tokens(state).token_ids.pop()
    return "decode lane: 1 tokens for 2 members"


def _lane_field(field: str) -> Callable[[CoreState], str]:
    def corrupt(state: CoreState) -> str:
        lane = state.lane
        assert lane is not None
        getattr(lane, field)[1] += 1
        return _lane_member(state, "b")
    return corrupt


def _lane_field_after_a_finished_member(state: CoreState) -> str:
    """A member that finished since the lane's step is skipped, and the members after it are still checked."""
    lane = state.lane
    assert lane is not None
    finished = copy.copy(lane.seqs[0])
    finished.status = Status.FINISHED
    lane.seqs[0] = finished
    lane.positions[1] += 1
    return _lane_member(state, "b")


def _lane_last_step(state: CoreState) -> str:
    state.seqs["b"].last_step -= 1
    return _lane_member(state, "b")


def _lane_partial_table(state: CoreState) -> str:
    lane = state.lane
    assert lane is not None
    state.seqs["b"].sent_blocks -= 1
    lane.sent_blocks[1] -= 1
    return _lane_member(state, "b")


def _lane_token(state: CoreState) -> str:
    lane = _with_tokens(state)
    lane.token_ids[1] += 1
    return f"decode lane: 'b': pending token {state.seqs['b'].outputs[-1]}, lane holds {lane.token_ids[1]}"


def _lane_forgets(state: CoreState) -> str:
    lane = state.lane
    assert lane is not None
    for column in (lane.seqs, lane.positions, lane.sample_indices, lane.sent_blocks):
        column.pop()
    return "decode lane: running 'b' is neither a member, prefilling, joining nor left out"


LANE_CORRUPTIONS: dict[str, Callable[[CoreState], str]] = {
    "column length": _lane_column,
    "running order": _lane_order,
    "token count": _lane_token_count,
    "position": _lane_field("positions"),
    "index": _lane_field("sample_indices"),
    "sent blocks": _lane_field("sent_blocks"),
    "position after a finished member": _lane_field_after_a_finished_member,
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
