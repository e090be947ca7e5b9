"""The core's mutable state: sequences, queues, steps in flight and fences (attrs, slots)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice
from operator import attrgetter

import attrs

from tickloom.engine.core.blocks import BlockPool
from tickloom.engine.core.config import CoreConfig
from tickloom.engine.core.errors import InvariantViolation
from tickloom.engine.core.status import Status
from tickloom.events import GENESIS_DIGEST, FinishReason, SamplingSpec


def ends_in_thinking(tokens: list[int], start: int | None, end: int | None) -> bool:
    """Whether ``tokens`` leave the model inside a thinking section (the last marker is think-start)."""
    if start is None:
        return False
    for token in reversed(tokens):
        if token in (start, end):
            return token == start
    return False


@attrs.define(slots=True, eq=False)
class Seq:
    """One request's scheduling state. ``tokens`` = prompt + outputs; the last output is the pending input."""

    request_id: str
    arrival: int
    priority: int
    prompt: list[int]
    params: SamplingSpec
    seed: int
    deadline_ns: int | None
    salt: str
    outputs: list[int] = attrs.Factory(list)
    status: Status = Status.WAITING
    admitted: int = -1
    block_ids: list[int] = attrs.Factory(list)
    sent_blocks: int = 0
    """How many of ``block_ids`` the executor has been told about (``RunStep`` carries only the rest)."""
    num_computed: int = 0
    """KV positions written or planned to be written by steps already emitted."""
    kv_settled: int = 0
    """KV positions written by settled steps: only these may enter the prefix cache."""
    inflight: int = 0
    """Rows of unsettled steps that sample a token for this sequence (at most ``pipeline_depth``)."""
    last_step: int = -1
    """The newest step that references this sequence's blocks."""
    hashes: list[bytes] = attrs.Factory(list)
    """Prefix-cache hashes of its full blocks, computed as they fill."""
    first_planned: bool = False
    cached_prompt_tokens: int = 0
    reserve: int = 0
    """Blocks the admission gate reserved for it; the unallocated rest counts as in-flight demand."""
    immune_until: int = -1
    """Output count below which it is skipped as a victim (set on resume)."""
    catch_up: int = 0
    """Outputs past the pending token whose KV no planned row writes yet: tokens a step accepted after its sampled
    one (``StepDone.extra_token_ids``). The next row of the sequence writes them, with the pending token, and
    samples; until then it counts as prefilling (``num_computed + catch_up == prefill_target``)."""
    void: int = 0
    """Rows in flight whose output an earlier step's extra tokens already supplied: they settle without a token.
    At most one (``pipeline_depth`` <= 2), and never together with ``catch_up``'s row in flight before it."""
    spec_k: int = 0
    """Proposal slots its next decode row asks for (speculative decoding; 0: none). Set at arrival for a request
    whose tokens do not depend on per-token columns or forced tokens, then adapted to what its rows accept."""
    spec_retry: int = -1
    """The output count from which a sequence whose ``spec_k`` fell to 0 proposes again (-1: never)."""
    spec_row: int = 0
    """The proposal slots of its row in flight (0: none). No row is fed from such a row: how many tokens it yields
    is unknown until it settles."""
    thinking: bool = False
    thinking_tokens: int = 0
    bound: bool = False
    spill_tokens: int = 0
    has_spill: bool = False
    """A copy of its KV exists in the spill store (dropped once no longer needed)."""
    swap_ready: bool = False
    finish_reason: FinishReason | None = None
    finish_index: int = -1
    finish_error: str = ""
    _stop_rule: tuple[frozenset[int], int] | None = None
    """Cache for ``settle.settle_step``: (stop token set, length limit), set on first use. Private, so snapshots
    (msgspec skips underscored attrs fields) do not hold it; a restored sequence recomputes it."""
    _run_order: int = -1
    """When it last joined ``running`` (``CoreState.next_run_order``), so ``lane`` can compare running order
    without a scan. Private like ``_stop_rule``: a restored sequence has -1, which only makes the lane stand
    down until the general plan rebuilds it."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.outputs)

    @property
    def prefill_target(self) -> int:
        """Positions to prefill: the prompt, or after a requeue the history minus the pending token."""
        return len(self.prompt) + len(self.outputs) - 1 if self.outputs else len(self.prompt)

    def tokens(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt)
        if end <= prompt_len:
            return self.prompt[start:end]
        if start >= prompt_len:
            return self.outputs[start - prompt_len : end - prompt_len]
        return self.prompt[start:] + self.outputs[: end - prompt_len]


_RUN_ORDER = attrgetter("_run_order")
_QUEUE_KEY = attrgetter("priority", "arrival")


class WaitingQueue:
    """The waiting queue: sequences by (priority, arrival), first come first served, every operation cheap.

    One list sorted by (priority, arrival) holds the queue from ``_head`` on. Admission takes the head by moving
    ``_head``; a request that leaves from elsewhere (cancel, time-out, shutdown) stays behind as a tombstone,
    recognised by its status no longer being ``WAITING``, and is skipped. Arrivals go in by binary search (an
    append in the usual FCFS case). Once the consumed head and the tombstones outnumber the live entries the list
    is rebuilt, so removals are amortised O(1) and a mass cancel of W requests costs O(W), not O(W^2).

    It reads like the list it replaces: ``len``, truth, iteration in queue order (live entries only), and
    ``append`` (which inserts in order).
    """

    __slots__ = ("_dead", "_head", "_items")

    def __init__(self, seqs: Iterable[Seq] = ()) -> None:
        self._items: list[Seq] = sorted(seqs, key=_QUEUE_KEY)
        self._head = 0
        self._dead = 0

    def __len__(self) -> int:
        return len(self._items) - self._head - self._dead

    def __bool__(self) -> bool:
        return len(self._items) - self._head > self._dead

    def __iter__(self) -> Iterator[Seq]:
        waiting = Status.WAITING
        return (seq for seq in islice(self._items, self._head, None) if seq.status is waiting)

    def __repr__(self) -> str:
        return f"WaitingQueue({[seq.request_id for seq in self]!r})"

    def insert(self, seq: Seq) -> None:
        """Queue a waiting sequence behind every one that comes before it by (priority, arrival)."""
        items = self._items
        key = (seq.priority, seq.arrival)
        if len(items) == self._head or _QUEUE_KEY(items[-1]) < key:
            items.append(seq)
        else:
            items.insert(bisect_right(items, key, self._head, key=_QUEUE_KEY), seq)

    append = insert

    def head(self) -> Seq | None:
        """The first live sequence, or None; tombstones before it are dropped."""
        items = self._items
        waiting = Status.WAITING
        while self._head < len(items):
            seq = items[self._head]
            if seq.status is waiting:
                return seq
            self._head += 1
            self._dead -= 1
        return None

    def pop_head(self) -> Seq:
        """Remove and return the head (``head()`` must have returned it)."""
        seq = self._items[self._head]
        self._head += 1
        self._compact()
        return seq

    def discard(self, seq: Seq) -> None:
        """Note that ``seq``, queued here, has left with another status: it is skipped from now on."""
        assert seq.status is not Status.WAITING, "a sequence leaves the waiting queue with its new status set"
        self._dead += 1
        self._compact()

    def _compact(self) -> None:
        gone = self._head + self._dead
        if gone > 32 and 2 * gone > len(self._items):
            waiting = Status.WAITING
            self._items = [seq for seq in islice(self._items, self._head, None) if seq.status is waiting]
            self._head = self._dead = 0


def find_in_run_order(seqs: list[Seq], seq: Seq) -> int:
    """The index of ``seq`` in ``seqs`` (a list in running order, such as ``running``), or -1 if absent.

    A binary search on ``_run_order``, which grows along running order, so that finding a finished sequence
    in a batch of thousands costs no scan. Sequences restored from a snapshot share the order -1 and are
    scanned among themselves.
    """
    order = seq._run_order
    i = bisect_left(seqs, order, key=_RUN_ORDER)
    while i < len(seqs) and seqs[i]._run_order == order:
        if seqs[i] is seq:
            return i
        i += 1
    return -1


@attrs.define(slots=True, eq=False)
class InflightStep:
    """A ``RunStep`` the executor has not reported on yet."""

    step_id: int
    seqs: list[Seq]
    """Every row's sequence, in row order."""
    samplers: list[Seq]
    """The sequences of sampling rows, in row order: ``StepDone`` lists exactly these."""
    sampler_indices: list[int]
    """The output index each of ``samplers`` samples (``RunStep.sample_indices`` without ``NO_SAMPLE`` rows)."""
    kv_ends: list[int]
    """Per row, the KV position its last token writes, plus one."""
    registered: list[int]
    """Blocks whose hashes this step's plan registered: untrusted if the step fails."""
    sampler_ids: list[str]
    """The request ids of ``samplers``: a ``StepDone`` must list exactly these (checked with one compare)."""
    ending: list[int]
    """Indices into ``samplers``, ascending, of the rows whose token reaches the sequence's length limit, so that
    settling need not test every row for it."""


@attrs.define(slots=True, eq=False)
class DecodeLane:
    """The newest step's decode rows as columns, so the next step's can be derived from them in bulk.

    ``engine.core.decode_lane`` explains when it holds; the columns are parallel, one entry per member.
    """

    step_id: int
    """The step whose decode rows the members had."""
    seqs: list[Seq]
    """In running order (``find_in_run_order`` finds a member's row)."""
    positions: list[int]
    """Each member's next position (its ``num_computed``)."""
    sample_indices: list[int]
    """The output index each member sampled in ``step_id``."""
    sent_blocks: list[int]
    """Each member's ``sent_blocks``, which is also the length of its block table: the table has been sent whole."""
    token_ids: list[int]
    """Each member's pending token, once ``step_id`` has settled (then ``token_ids_step == step_id``): settling
    hands over the step's sampled tokens, so the plan need not read every member's last output."""
    token_ids_step: int
    last_rows: dict[int, list[Seq]]
    """A timer wheel: step id -> the members whose row in that step samples their last token by length. A
    member's index grows by one every step it stays in the lane, so the step is known when it joins."""
    prefilling: list[Seq]
    """Running sequences still prefilling, in running order."""
    joining: list[Seq]
    """Sequences whose prefill was completed by ``step_id``: decode rows from the next step on."""
    left_out: list[Seq]
    """Decode sequences that got no row in ``step_id`` (no room to run ahead, no blocks): the lane holds only
    while every one of them has finished."""


@attrs.define(slots=True, eq=False)
class CoreState:
    """Everything the core knows. ``scheduler.SchedulerCore`` owns one; the phase functions mutate it."""

    config: CoreConfig
    pool: BlockPool
    seqs: dict[str, Seq] = attrs.Factory(dict)
    waiting: WaitingQueue = attrs.Factory(WaitingQueue)
    """By (priority, arrival); only the head may be admitted (no overtaking)."""
    running: list[Seq] = attrs.Factory(list)
    """Admitted sequences in admission order. Finished ones linger until ``plan_step`` prunes them (the
    reference scheduler's order, which ``_needs_tick`` observes), so the active count is
    ``len(running) - len(finished_in_running)``."""
    finished_in_running: list[Seq] = attrs.Factory(list)
    """The finished sequences still in ``running`` (added by ``mark_finish``, removed by the prune)."""
    reserving: list[Seq] = attrs.Factory(list)
    """Running sequences that may hold fewer blocks than their reservation (``in_flight_demand`` sums only
    these). A sequence joins at admission or resume, the only points that raise ``reserve`` above what it holds,
    and leaves once it holds its reservation, which it then keeps until it stops running."""
    preempted: list[Seq] = attrs.Factory(list)
    swapping_or_swapped: list[Seq] = attrs.Factory(list)
    """Swapped-out sequences in swap-out order: those whose KV is still being spilled (``SWAPPING``) and those whose
    KV is in the spill store (``SWAPPED``). One list, so that swap-in serves them in swap-out order."""
    finishing: list[Seq] = attrs.Factory(list)
    """Marked finished during this tick, retired at its end."""
    fences: deque[tuple[int, str, list[int]]] = attrs.Factory(deque)
    """(step id, request id, blocks): blocks of retired sequences, released when that step settles."""
    steps: deque[InflightStep] = attrs.Factory(deque)
    deadlines: list[tuple[int, int, str]] = attrs.Factory(list)
    """Heap of (deadline_ns, arrival, request id). Entries of finished requests are skipped when popped, and
    compacted away (``deadlines.compact_deadlines``) once they outnumber the live ones, so the heap stays bounded
    by the live requests."""
    tick: int = -1
    now_ns: int = 0
    next_step_id: int = 0
    settled_step: int = -1
    next_arrival: int = 0
    next_admission: int = 0
    digest: bytes = GENESIS_DIGEST
    shut_down: bool = False
    void_rows: int = 0
    """The sum of every sequence's ``void``: while it is 0 (always, without extra tokens) a step settles in bulk."""
    spec_rows: int = 0
    """Rows in flight with proposal slots (sequences with ``spec_row``): while there are any, steps settle row by
    row."""
    stop_tokens: set[int] = attrs.Factory(set)
    """Every token that may stop some live request: a step whose tokens miss it stops nothing. Kept exact by
    ``stop_refs`` (``finish.track_stops`` / ``untrack_stops``), so finished requests do not widen it."""
    stop_refs: dict[int, int] = attrs.Factory(dict)
    """Token -> how many live requests it may stop (the keys are ``stop_tokens``)."""
    lane: DecodeLane | None = None
    """The steady-state fast path's view of the newest step (``engine.core.decode_lane``); None when it must stand
    down. Derived state, never snapshotted: a restored core plans its first step the general way."""
    next_run_order: int = 0

    def join_running(self, seq: Seq) -> None:
        """Append a sequence to ``running`` (admission, resume, swap-in): the only way into it.

        A sequence that still has to prefill joins the lane's ``prefilling``, at the end like in ``running``. One
        that decodes at once (swapped in, or resumed with its whole history in the prefix cache) stands the lane
        down: it gets a decode row in the next step, in running order, which only the general plan places.
        """
        seq._run_order = self.next_run_order
        self.next_run_order += 1
        self.running.append(seq)
        if self.lane is not None:
            if seq.num_computed < seq.prefill_target:
                self.lane.prefilling.append(seq)
            else:
                self.lane = None

    @property
    def active(self) -> int:
        """Running sequences that are not finished: what ``max_batch_size`` bounds."""
        return len(self.running) - len(self.finished_in_running)

    def prune_running(self) -> None:
        """Drop the finished sequences from ``running`` (a no-op when none is)."""
        finished = self.finished_in_running
        if finished:
            if len(finished) * 8 < len(self.running):
                # A few finishes in a big batch (the steady state): each is found by a binary search.
                running = self.running
                for seq in finished:
                    i = find_in_run_order(running, seq)
                    if i < 0:
                        raise InvariantViolation(
                            "finished sequences leave running once",
                            f"{seq.request_id!r} is listed as finished in running but is not in it",
                        )
                    del running[i]
            else:
                self.running = [seq for seq in self.running if seq.status is Status.RUNNING]
            finished.clear()

    @classmethod
    def create(cls, config: CoreConfig) -> CoreState:
        return cls(config=config, pool=BlockPool.create(config.num_blocks))
