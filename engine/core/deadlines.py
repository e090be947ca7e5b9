"""Deadlines: the sweep that times requests out, and the bound on the deadline heap.

``SchedulerCore.tick`` sweeps before admission, so a request already past its deadline is never admitted or planned;
the heap is compacted after retirement.
"""

from __future__ import annotations

import heapq

from tickloom.engine.core.finish import mark_finish
from tickloom.engine.core.state import CoreState


def sweep_deadlines(state: CoreState) -> None:
    """Time out every live request whose deadline has passed or whose ``DeadlineReached`` arrived.

    Checks waiting, running, preempted and swapped requests alike, and also requests that another reason
    finished in this tick (a timeout at the same token takes precedence).
    """
    heap = state.deadlines
    now = state.now_ns
    while heap and heap[0][0] <= now:
        _, arrival, request_id = heapq.heappop(heap)
        seq = state.seqs.get(request_id)
        if seq is not None and seq.arrival == arrival:
            mark_finish(state, seq, "timeout", len(seq.outputs) - 1)


DEADLINE_SLACK = 64
"""Dead heap entries tolerated beyond the live requests' count before ``compact_deadlines`` rebuilds the heap."""


def live_deadlines(state: CoreState) -> list[tuple[int, int, str]]:
    """The heap entries of live requests, one per request (its earliest), sorted: itself a valid heap.

    An entry is live while its request is (the same arrival: a request id may be reused after it finishes). A
    ``DeadlineReached`` adds a second entry for its request, due at once; the later one is dropped.
    """
    seqs = state.seqs
    live = sorted(entry for entry in state.deadlines
                  if (seq := seqs.get(entry[2])) is not None and seq.arrival == entry[1])
    seen: set[str] = set()
    kept = []
    for entry in live:
        if entry[2] not in seen:
            seen.add(entry[2])
            kept.append(entry)
    return kept


def compact_deadlines(state: CoreState) -> None:
    """Drop the entries of finished requests once they could outnumber the live ones (after retirement).

    Popping still skips dead entries; this only bounds the heap's size by the live requests. The rebuild costs
    O(heap) and leaves at most one entry per live request, so it runs only after as many entries died or were
    added, which keeps it amortised O(1) per request. Pop order is unchanged: entries are distinct tuples.
    """
    if len(state.deadlines) > 2 * len(state.seqs) + DEADLINE_SLACK:
        state.deadlines = live_deadlines(state)
