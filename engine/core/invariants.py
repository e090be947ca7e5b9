"""The invariants (ARCHITECTURE.md, "Invariants"), checked against the whole state.

They are on in tests, the simulator and debug runs.

Each check raises ``InvariantViolation`` naming the invariant and the requests or blocks involved. The
liveness and "every request ends exactly once" invariants span many ticks; the test harness checks those.
"""

from __future__ import annotations

from collections import Counter

from tickloom.engine.core.errors import InvariantViolation
from tickloom.engine.core.state import CoreState, Seq
from tickloom.engine.core.status import PARKED, QUEUE_OF, TRANSITIONS, Status

_QUEUE_NAMES = tuple(dict.fromkeys(QUEUE_OF.values()))
"""The queues ``QUEUE_OF`` names, each once: waiting, running, preempted, swapping_or_swapped."""

_LIVE = frozenset(source for source, _ in TRANSITIONS)
"""The statuses the transition table still moves on: between ticks every tracked request has one."""


def check_invariants(state: CoreState) -> None:
    """Raise ``InvariantViolation`` if any invariant fails."""
    check_blocks(state)
    check_fences(state)
    check_queues(state)
    check_bounds(state)
    check_lane(state)


def check_blocks(state: CoreState) -> None:
    """Block conservation: free + cached + in use == total, and refcounts match the tables and fences."""
    pool = state.pool
    holders: Counter[int] = Counter()
    for seq in state.seqs.values():
        if len(set(seq.block_ids)) != len(seq.block_ids):
            raise InvariantViolation("block conservation", f"{seq.request_id!r} holds a block twice: {seq.block_ids}")
        holders.update(seq.block_ids)
    for _, _, blocks in state.fences:
        holders.update(blocks)
    in_use = sum(1 for count in pool.ref if count > 0)
    if pool.num_free + pool.num_cached + in_use != pool.num_blocks:
        raise InvariantViolation(
            "block conservation",
            f"free {pool.num_free} + cached {pool.num_cached} + in use {in_use} != total {pool.num_blocks}",
        )
    for block in range(pool.num_blocks):
        if pool.ref[block] != holders[block]:
            owners = [s.request_id for s in state.seqs.values() if block in s.block_ids]
            raise InvariantViolation(
                "block conservation",
                f"block {block} has refcount {pool.ref[block]} but {holders[block]} holders {owners}",
            )
        in_free, in_cached = block in pool.free, block in pool.cached
        if pool.ref[block] > 0 and (in_free or in_cached):
            raise InvariantViolation("block conservation", f"block {block} is in use and also free")
        if pool.ref[block] == 0 and in_free == in_cached:
            raise InvariantViolation("block conservation", f"unreferenced block {block} must be free or cached")
        if in_free and pool.hash_of[block] is not None:
            raise InvariantViolation("prefix cache", f"free block {block} still has a hash")
        if in_cached and pool.hash_of[block] is None:
            raise InvariantViolation("prefix cache", f"cached block {block} has no hash")
    for h, block in pool.by_hash.items():
        if pool.hash_of[block] != h:
            raise InvariantViolation("prefix cache", f"hash index names block {block}, which has another hash")
    if len(pool.by_hash) != sum(1 for h in pool.hash_of if h is not None):
        raise InvariantViolation("prefix cache", "hash index and block hashes disagree")


def check_fences(state: CoreState) -> None:
    """No block is freed while an unsettled step references it; no row of an unsettled step was preempted."""
    fenced = {(request_id, step) for step, request_id, _ in state.fences}
    for step in state.steps:
        for seq in step.seqs:
            live = state.seqs.get(seq.request_id) is seq
            if live and seq.status in PARKED:
                raise InvariantViolation(
                    "fences", f"{seq.request_id!r} was preempted while step {step.step_id} references it"
                )
            if live and seq.status is Status.RUNNING:
                continue
            if (seq.request_id, seq.last_step) not in fenced or seq.last_step < step.step_id:
                raise InvariantViolation(
                    "fences", f"finished {seq.request_id!r} is referenced by step {step.step_id} but not fenced"
                )
    for step_id, _, _ in state.fences:
        if step_id <= state.settled_step:
            raise InvariantViolation("fences", f"a fence for settled step {step_id} still holds blocks")


def check_queues(state: CoreState) -> None:
    """Each live request is in exactly the queue its status names (``status.QUEUE_OF``), with a status the
    transition table still moves on."""
    counts: Counter[str] = Counter()  # by request id: each queued sequence is checked to be the live one
    for name in _QUEUE_NAMES:
        queue: list[Seq] = list(getattr(state, name))
        for seq in queue:
            if name == "running" and seq.status is not Status.RUNNING:
                continue  # finished, pruned at the next plan
            if QUEUE_OF.get(seq.status) != name or state.seqs.get(seq.request_id) is not seq:
                raise InvariantViolation("queues", f"{seq.request_id!r} ({seq.status.name}) is in {name}")
            counts[seq.request_id] += 1
        if name == "waiting":
            if len(state.waiting) != len(queue):
                raise InvariantViolation("queues", f"the waiting queue counts {len(state.waiting)} but holds "
                                         f"{len(queue)}")
            keys = [(seq.priority, seq.arrival) for seq in queue]
            if keys != sorted(keys):
                raise InvariantViolation("queues", "the waiting queue is out of (priority, arrival) order")
    for seq in state.seqs.values():
        if seq.status not in _LIVE:
            raise InvariantViolation("endings", f"{seq.request_id!r} is {seq.status.name} but was not retired")
        if counts[seq.request_id] != 1:
            raise InvariantViolation("queues", f"{seq.request_id!r} ({seq.status.name}) is not queued once")
    if state.finishing:
        raise InvariantViolation("endings", "finished requests were left unretired at the end of a tick")


def check_bounds(state: CoreState) -> None:
    """active <= max_batch_size; prompt + output <= max_seq_len; output <= max_tokens."""
    config = state.config
    active = sum(1 for seq in state.running if seq.status is Status.RUNNING)
    if active > config.max_batch_size:
        raise InvariantViolation("bounds", f"{active} active sequences > max_batch_size={config.max_batch_size}")
    for seq in state.seqs.values():
        if seq.num_tokens > config.max_seq_len:
            raise InvariantViolation("bounds", f"{seq.request_id!r} holds {seq.num_tokens} > max_seq_len")
        if len(seq.outputs) > seq.params.max_tokens:
            raise InvariantViolation("bounds", f"{seq.request_id!r} has {len(seq.outputs)} > max_tokens outputs")
        if seq.inflight < 0 or seq.inflight > config.pipeline_depth:
            raise InvariantViolation("fences", f"{seq.request_id!r} has {seq.inflight} tokens in flight")
        if not 0 <= seq.void <= seq.inflight:
            raise InvariantViolation("fences", f"{seq.request_id!r} has {seq.void} void rows, {seq.inflight} in flight")
        if seq.spec_row and not (seq.inflight and seq.spec_row <= config.speculative_tokens and not seq.void):
            raise InvariantViolation("fences", f"{seq.request_id!r} has a row with {seq.spec_row} proposal slots, "
                                     f"{seq.inflight} rows in flight, {seq.void} void")
    speculating = {seq.request_id for step in state.steps for seq in step.samplers if seq.spec_row}
    if state.spec_rows != len(speculating):
        raise InvariantViolation("fences", f"{state.spec_rows} rows with proposal slots counted, "
                                 f"{len(speculating)} in flight")


def check_lane(state: CoreState) -> None:
    """The decode lane, if any, agrees with the sequences it describes and misses no running sequence."""
    lane = state.lane
    if lane is None:
        return
    columns = (lane.positions, lane.sample_indices, lane.sent_blocks)
    if any(len(column) != len(lane.seqs) for column in columns):
        raise InvariantViolation("decode lane", f"columns of lengths {[len(c) for c in columns]} "
                                 f"for {len(lane.seqs)} members")
    orders = [seq._run_order for seq in lane.seqs]
    if orders != sorted(orders):
        raise InvariantViolation("decode lane", "members out of running order")
    with_tokens = lane.token_ids_step == lane.step_id
    if with_tokens and len(lane.token_ids) != len(lane.seqs):
        raise InvariantViolation("decode lane", f"{len(lane.token_ids)} tokens for {len(lane.seqs)} members")
    for i, seq in enumerate(lane.seqs):
        if seq.status is not Status.RUNNING:
            continue  # finished since the lane's step; dropped at the next plan
        expected = (seq.num_computed, len(seq.outputs) + seq.inflight, seq.sent_blocks)
        found = (lane.positions[i], lane.sample_indices[i], lane.sent_blocks[i])
        if found != expected or seq.last_step != lane.step_id or seq.sent_blocks != len(seq.block_ids):
            raise InvariantViolation(
                "decode lane",
                f"{seq.request_id!r}: lane (position, index, sent) {found} but the sequence has {expected}, "
                f"last step {seq.last_step} (lane step {lane.step_id}), {len(seq.block_ids)} blocks",
            )
        if with_tokens and lane.token_ids[i] != seq.outputs[-1]:
            raise InvariantViolation("decode lane", f"{seq.request_id!r}: pending token {seq.outputs[-1]}, "
                                     f"lane holds {lane.token_ids[i]}")
    known = {seq.request_id for group in (lane.seqs, lane.prefilling, lane.joining, lane.left_out) for seq in group}
    for seq in state.running:
        if seq.status is Status.RUNNING and seq.request_id not in known:
            raise InvariantViolation("decode lane", f"running {seq.request_id!r} is neither a member, prefilling, "
                                     "joining nor left out")
