"""C01: the waiting queue's own contract (``engine/core/state.py``, ``WaitingQueue``), one rule per test.

The queue keeps (priority, arrival) order with cheap removals: a request that leaves from the middle stays as a
tombstone, and the list is rebuilt only once the consumed head and the tombstones outnumber the live entries (and
there are more than 32 of them), so a mass cancel is linear.
"""

from __future__ import annotations

from core_state import add_seq, make_core

from tickloom.engine.core.state import CoreState, Seq, WaitingQueue
from tickloom.engine.core.status import Status


def _queue(n: int) -> tuple[CoreState, WaitingQueue, list[Seq]]:
    state = make_core(num_blocks=16, block_size=16, max_seq_len=128).state
    seqs = [add_seq(state, f"w{i}", 4, status=Status.WAITING) for i in range(n)]
    return state, WaitingQueue(seqs), seqs


def _cancel(queue: WaitingQueue, seqs: list[Seq]) -> None:
    for seq in seqs:
        seq.status = Status.FINISHED
        queue.discard(seq)


def test_queue_order_is_priority_then_arrival_whatever_the_insertion_order() -> None:
    state, queue, _ = _queue(0)
    late_urgent = add_seq(state, "late-urgent", 4, status=Status.WAITING, priority=-1)
    first, second = (add_seq(state, name, 4, status=Status.WAITING) for name in ("first", "second"))
    for seq in (second, late_urgent, first):
        queue.insert(seq)
    assert [seq.request_id for seq in queue] == ["late-urgent", "first", "second"]
    assert queue.head() is late_urgent and len(queue) == 3


def test_a_removed_request_is_skipped_by_iteration_length_and_head() -> None:
    _, queue, seqs = _queue(3)
    _cancel(queue, seqs[:1])
    assert [seq.request_id for seq in queue] == ["w1", "w2"] and len(queue) == 2 and bool(queue)
    assert queue.head() is seqs[1]
    _cancel(queue, seqs[1:])
    assert not queue and len(queue) == 0 and queue.head() is None


def test_pop_head_takes_the_head_and_the_next_one_follows() -> None:
    _, queue, seqs = _queue(3)
    assert queue.head() is seqs[0] and queue.pop_head() is seqs[0]
    seqs[0].status = Status.RUNNING
    assert queue.head() is seqs[1] and [seq.request_id for seq in queue] == ["w1", "w2"]


def test_the_list_is_rebuilt_once_the_dead_outnumber_the_live() -> None:
    _, queue, seqs = _queue(66)
    _cancel(queue, seqs[:33])
    assert len(queue._items) == 66, "33 dead of 66: not more than the live ones yet"
    _cancel(queue, seqs[33:34])
    assert len(queue._items) == 32 and queue._head == queue._dead == 0
    assert [seq.request_id for seq in queue] == [f"w{i}" for i in range(34, 66)]


def test_the_list_is_not_rebuilt_for_32_dead_or_fewer() -> None:
    _, queue, seqs = _queue(40)
    _cancel(queue, seqs[:32])
    assert len(queue._items) == 40, "32 dead outnumber the 8 live, but 32 is not more than 32"
    _cancel(queue, seqs[32:33])
    assert len(queue._items) == 7


def test_consumed_heads_count_as_dead_for_the_rebuild() -> None:
    _, queue, seqs = _queue(66)
    for seq in seqs[:34]:
        assert queue.head() is seq
        queue.pop_head()
        seq.status = Status.RUNNING
    assert len(queue._items) == 32 and next(seq.request_id for seq in queue) == "w34"
