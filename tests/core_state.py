"""Builders for hand-made core states, for scenarios that start from a precise pool layout."""

from __future__ import annotations

from tickloom.engine.core import CoreConfig, SchedulerCore
from tickloom.engine.core.context import TickContext
from tickloom.engine.core.prefix_cache import full_block_hashes
from tickloom.engine.core.snapshot import CoreSnapshot
from tickloom.engine.core.state import CoreState, Seq
from tickloom.engine.core.status import Status
from tickloom.events import BindRequest, Command, Input, SamplingSpec, TickInputs, TickOutputs

THINK_START, THINK_END = 5, 6
"""The think markers of the core scenarios that configure thinking (the oracles avoid them unless scripted)."""


def make_core(**config: object) -> SchedulerCore:
    core = SchedulerCore(CoreConfig(**config))  # type: ignore[arg-type]
    core.state.tick = 0
    return core


def add_seq(
    state: CoreState,
    request_id: str,
    prompt: int,
    outputs: int = 0,
    status: Status = Status.RUNNING,
    *,
    priority: int = 0,
    max_tokens: int = 100,
) -> Seq:
    """A sequence in ``status``, with made-up tokens, holding no blocks yet."""
    arrival = state.next_arrival
    state.next_arrival += 1
    seq = Seq(
        request_id, arrival, priority, [100 + (arrival * 31 + i) % 500 for i in range(prompt)],
        SamplingSpec(max_tokens=max_tokens), arrival, None, "",
    )
    seq.outputs = [600 + (arrival * 17 + i) % 300 for i in range(outputs)]
    seq.status = status
    seq.bound = True
    state.seqs[request_id] = seq
    if status is Status.RUNNING:
        seq.admitted = state.next_admission
        state.next_admission += 1
        state.running.append(seq)
    elif status is Status.PREEMPTED:
        state.preempted.append(seq)
    elif status in (Status.SWAPPED, Status.SWAPPING):
        state.swapping_or_swapped.append(seq)
    return seq


def add_prefilling(state: CoreState, request_id: str, prompt: int, computed: int, blocks: int, last_step: int) -> Seq:
    """A running sequence part-way through its prompt, with ``blocks`` blocks and its last chunk in ``last_step``."""
    seq = add_seq(state, request_id, prompt)
    seq.block_ids = state.pool.allocate(blocks)
    seq.sent_blocks = blocks
    seq.num_computed = computed
    seq.kv_settled = computed if last_step <= state.settled_step else 0
    seq.first_planned = True
    seq.last_step = last_step
    return seq


def add_swapped(state: CoreState, request_id: str, prompt: int) -> Seq:
    """A swapped sequence with 5 outputs, its spilled KV (all but the pending token) ready in the host tier."""
    seq = add_seq(state, request_id, prompt, outputs=5, status=Status.SWAPPED)
    seq.spill_tokens, seq.swap_ready, seq.has_spill = seq.num_tokens - 1, True, True
    return seq


def hold_blocks(state: CoreState, seq: Seq, n: int) -> None:
    """Give a running sequence ``n`` blocks, its KV computed and settled up to its pending token."""
    seq.block_ids = state.pool.allocate(n)
    seq.sent_blocks = n
    seq.num_computed = seq.kv_settled = seq.num_tokens - 1 if seq.outputs else 0
    seq.first_planned = True
    seq.reserve = n


def cache_unrelated(state: CoreState, n: int, salt: str = "other") -> None:
    """Put ``n`` blocks of unrelated content in the prefix cache (hashed, unreferenced)."""
    for i in range(n):
        [block] = state.pool.allocate(1)
        state.pool.register(block, f"{salt}-{i}".encode().ljust(16, b"."))
        state.pool.release([block])


def cache_prefix_of(state: CoreState, seq: Seq, tokens: int) -> list[int]:
    """Put the full blocks of ``seq``'s first ``tokens`` tokens in the prefix cache; returns their blocks."""
    hashes = full_block_hashes(state, seq, tokens)
    blocks = state.pool.allocate(len(hashes))
    for block, h in zip(blocks, hashes, strict=True):
        state.pool.register(block, h)
    state.pool.release(blocks)
    return blocks


def context() -> TickContext:
    return TickContext()


def tick(core: SchedulerCore, *inputs: Input) -> TickOutputs:
    """The core's next tick at an unchanged clock, then its invariants."""
    out = core.tick(TickInputs(core.state.tick + 1, core.state.now_ns, list(inputs)))
    core.check_invariants()
    return out


def commands_of(out: TickOutputs, kind: type) -> list[Command]:
    return [c for c in out.commands if isinstance(c, kind)]


def bound(out: TickOutputs) -> list[str]:
    """Request ids given a ``BindRequest`` in ``out``: the ones admitted or resumed."""
    return [c.request_id for c in commands_of(out, BindRequest)]


def snap_seq(snap: CoreSnapshot, request_id: str) -> Seq:
    return next(seq for seq in snap.seqs[: snap.live] if seq.request_id == request_id)


def waiting_ids(snap: CoreSnapshot) -> list[str]:
    """The waiting queue of a snapshot, as request ids in queue order."""
    return [snap.seqs[i].request_id for i in snap.waiting]
