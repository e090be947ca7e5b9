"""Snapshots of the whole core state, for seek, bisect and checking that a restored core continues identically.

A snapshot is a msgspec Struct holding copies (never references) of every sequence the state can reach,
including finished ones that an unsettled step still references, with queues and steps naming them by index.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import msgspec

from tickloom.engine.core.blocks import BlockPool
from tickloom.engine.core.config import CoreConfig
from tickloom.engine.core.deadlines import live_deadlines
from tickloom.engine.core.finish import stop_rule, track_stops
from tickloom.engine.core.state import CoreState, InflightStep, Seq, WaitingQueue
from tickloom.engine.core.status import Status


class StepSnapshot(msgspec.Struct, frozen=True, array_like=True):
    """An unsettled step; rows name sequences by their index in ``CoreSnapshot.seqs``."""

    step_id: int
    seqs: list[int]
    samplers: list[int]
    sampler_indices: list[int]
    kv_ends: list[int]
    registered: list[int]


class PoolSnapshot(msgspec.Struct, frozen=True, array_like=True):
    """The block pool: refcounts, hashes, and the free and cached queues in their reuse order."""

    ref: list[int]
    hash_of: list[bytes | None]
    free: list[int]
    cached: list[int]


class CoreSnapshot(msgspec.Struct, frozen=True):
    """The whole core state after ``tick``. ``SchedulerCore.from_snapshot`` continues from it identically."""

    config: CoreConfig
    tick: int
    now_ns: int
    digest: bytes
    seqs: list[Seq]
    live: int
    """``seqs[:live]`` are the live requests, in arrival order."""
    waiting: list[int]
    running: list[int]
    preempted: list[int]
    swapping_or_swapped: list[int] = msgspec.field(name="swapped")
    """(Encoded as ``swapped``, its name in snapshots logged before the rename.)"""
    steps: list[StepSnapshot]
    fences: list[tuple[int, str, list[int]]]
    deadlines: list[tuple[int, int, str]]
    """The live requests' deadline entries (one each, sorted, so a valid heap); finished ones are left out."""
    pool: PoolSnapshot
    next_step_id: int
    settled_step: int
    next_arrival: int
    next_admission: int
    shut_down: bool


_encoder = msgspec.msgpack.Encoder(order="deterministic")
_decoder = msgspec.msgpack.Decoder(CoreSnapshot)


def encode_snapshot(snapshot: CoreSnapshot) -> bytes:
    return _encoder.encode(snapshot)


def decode_snapshot(data: bytes | memoryview) -> CoreSnapshot:
    return _decoder.decode(data)


def take_snapshot(state: CoreState) -> CoreSnapshot:
    """A deep copy of ``state`` as a ``CoreSnapshot``."""
    seqs: list[Seq] = list(state.seqs.values())
    index: dict[Seq, int] = {seq: i for i, seq in enumerate(seqs)}  # by identity: Seq has eq=False

    def ref(seq: Seq) -> int:
        i = index.get(seq)
        if i is None:
            i = index[seq] = len(seqs)
            seqs.append(seq)
        return i

    waiting = [ref(s) for s in state.waiting]
    running = [ref(s) for s in state.running]
    preempted = [ref(s) for s in state.preempted]
    swapping_or_swapped = [ref(s) for s in state.swapping_or_swapped]
    steps = [
        StepSnapshot(step.step_id, [ref(s) for s in step.seqs], [ref(s) for s in step.samplers],
                     list(step.sampler_indices), list(step.kv_ends), list(step.registered))
        for step in state.steps
    ]
    pool = state.pool
    shallow = CoreSnapshot(
        config=state.config,
        tick=state.tick,
        now_ns=state.now_ns,
        digest=state.digest,
        seqs=seqs,
        live=len(state.seqs),
        waiting=waiting,
        running=running,
        preempted=preempted,
        swapping_or_swapped=swapping_or_swapped,
        steps=steps,
        fences=[(step, rid, list(blocks)) for step, rid, blocks in state.fences],
        deadlines=live_deadlines(state),
        pool=PoolSnapshot(list(pool.ref), list(pool.hash_of), list(pool.free), list(pool.cached)),
        next_step_id=state.next_step_id,
        settled_step=state.settled_step,
        next_arrival=state.next_arrival,
        next_admission=state.next_admission,
        shut_down=state.shut_down,
    )
    return decode_snapshot(encode_snapshot(shallow))


def _restore_step(config: CoreConfig, step: StepSnapshot, seqs: list[Seq]) -> InflightStep:
    samplers = [seqs[i] for i in step.samplers]
    ending = [
        i for i, (seq, index) in enumerate(zip(samplers, step.sampler_indices, strict=True))
        if index + 1 >= stop_rule(config, seq)[1]
    ]
    return InflightStep(step.step_id, [seqs[i] for i in step.seqs], samplers, list(step.sampler_indices),
                        list(step.kv_ends), list(step.registered), [seq.request_id for seq in samplers], ending)


def restore_state(snapshot: CoreSnapshot) -> CoreState:
    """A fresh ``CoreState`` equal to the one ``snapshot`` was taken of; the snapshot is left untouched."""
    snap = decode_snapshot(encode_snapshot(snapshot))
    seqs = snap.seqs
    config = snap.config
    pool = BlockPool(
        num_blocks=config.num_blocks,
        ref=list(snap.pool.ref),
        hash_of=list(snap.pool.hash_of),
        by_hash={h: block for block, h in enumerate(snap.pool.hash_of) if h is not None},
        free=OrderedDict.fromkeys(snap.pool.free),
        cached=OrderedDict.fromkeys(snap.pool.cached),
    )
    state = CoreState(config=config, pool=pool)
    state.seqs = {seq.request_id: seq for seq in seqs[: snap.live]}
    state.void_rows = sum(seq.void for seq in seqs)
    state.spec_rows = sum(1 for seq in seqs if seq.spec_row)
    state.waiting = WaitingQueue(seqs[i] for i in snap.waiting)
    state.running = [seqs[i] for i in snap.running]
    state.finished_in_running = [seq for seq in state.running if seq.status is not Status.RUNNING]
    state.reserving = [s for s in state.running if s.status is Status.RUNNING and s.reserve > len(s.block_ids)]
    state.preempted = [seqs[i] for i in snap.preempted]
    state.swapping_or_swapped = [seqs[i] for i in snap.swapping_or_swapped]
    state.steps = deque(_restore_step(config, s, seqs) for s in snap.steps)
    for seq in state.seqs.values():
        track_stops(state, seq)
    state.fences = deque((step, rid, list(blocks)) for step, rid, blocks in snap.fences)
    state.deadlines = list(snap.deadlines)
    state.tick = snap.tick
    state.now_ns = snap.now_ns
    state.digest = snap.digest
    state.next_step_id = snap.next_step_id
    state.settled_step = snap.settled_step
    state.next_arrival = snap.next_arrival
    state.next_admission = snap.next_admission
    state.shut_down = snap.shut_down
    return state
