"""A sequence's status and the one table of how it may change, in h11's manner.

``Status`` says where a sequence is, ``StatusEvent`` what moves it, and ``TRANSITIONS`` lists every legal
``(from, event) -> to``. ``change_status`` is the only code that assigns ``Seq.status``: the phases call it for
admission, preemption, the spill's outcome, swap-in, resume and every finish, and it refuses a move the table does not
list with ``InvariantViolation``, naming from, event and to. No module outside ``engine.core`` changes a status.

Two more facts every phase and the invariant checker must agree on live here: the ``CoreState`` queue each live status
keeps its sequence in (``QUEUE_OF``), and which finish reason stands when several apply at one token
(``FINISH_PRECEDENCE``, which the retire actor's stream assembly reads too).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum, IntEnum
from typing import TYPE_CHECKING

from tickloom.engine.core.errors import InvariantViolation
from tickloom.events import FinishReason

if TYPE_CHECKING:
    from tickloom.engine.core.state import Seq


class Status(IntEnum):
    """Where a sequence is. It changes only through ``change_status``, along ``TRANSITIONS``."""

    WAITING = 0
    """Arrived, not admitted."""
    RUNNING = 1
    """Admitted: prefilling (``num_computed < prefill_target``) or decoding."""
    PREEMPTED = 2
    """Requeued for recompute; resumes through ``resume_preempted``."""
    SWAPPING = 3
    """Its KV is being spilled (``SpillOut`` sent, ``SpillDone`` not yet in)."""
    SWAPPED = 4
    """Its KV is in the spill store; comes back only through ``swap_in``."""
    FINISHED = 5
    """Marked finished this tick; retired at the end of the tick."""


class StatusEvent(Enum):
    """What moves a sequence from one status to another."""

    ADMIT = "admit"
    """Admission takes it from the head of the waiting queue (``admission.admit``)."""
    SWAP_OUT = "swap out"
    """Preempted with a spill store: its KV is copied out (``preemption.take_off_device``)."""
    REQUEUE = "requeue"
    """Preempted without a spill store, or while prefilling: its KV is dropped (``preemption.take_off_device``)."""
    SPILL_DONE = "spill done"
    """Its ``SpillDone`` reported success (``apply.spill_done``)."""
    SPILL_FAILED = "spill failed"
    """Its ``SpillDone`` reported a failure: it falls back to recompute (``apply.spill_done``)."""
    SWAP_IN = "swap in"
    """Its KV is copied back into fresh blocks (``tick_end.swap_back_in``)."""
    RESUME = "resume"
    """A requeued sequence gets blocks again, to re-prefill its history (``tick_end.resume_preempted``)."""
    FINISH = "finish"
    """A finish reason applies (``finish.mark_finish``); it is retired at the end of the tick."""


_S = Status
_E = StatusEvent

TRANSITIONS: Mapping[tuple[Status, StatusEvent], Status] = {
    (_S.WAITING, _E.ADMIT): _S.RUNNING,
    (_S.RUNNING, _E.SWAP_OUT): _S.SWAPPING,
    (_S.RUNNING, _E.REQUEUE): _S.PREEMPTED,
    (_S.SWAPPING, _E.SPILL_DONE): _S.SWAPPED,
    (_S.SWAPPING, _E.SPILL_FAILED): _S.PREEMPTED,
    (_S.SWAPPED, _E.SWAP_IN): _S.RUNNING,
    (_S.PREEMPTED, _E.RESUME): _S.RUNNING,
    (_S.WAITING, _E.FINISH): _S.FINISHED,
    (_S.RUNNING, _E.FINISH): _S.FINISHED,
    (_S.PREEMPTED, _E.FINISH): _S.FINISHED,
    (_S.SWAPPING, _E.FINISH): _S.FINISHED,
    (_S.SWAPPED, _E.FINISH): _S.FINISHED,
}
"""Every legal status change. A finished sequence moves no more: it is retired at the end of its tick."""

QUEUE_OF: Mapping[Status, str] = {
    _S.WAITING: "waiting",
    _S.RUNNING: "running",
    _S.PREEMPTED: "preempted",
    _S.SWAPPING: "swapping_or_swapped",
    _S.SWAPPED: "swapping_or_swapped",
}
"""The ``CoreState`` queue that holds a live sequence of each status. A finished one is in none, except that a
sequence finished while running stays in ``running`` until the next plan prunes it."""

PARKED: frozenset[Status] = frozenset({_S.PREEMPTED, _S.SWAPPING, _S.SWAPPED})
"""Preempted, one way or the other: its blocks are off the device until it comes back through resume or swap-in."""

FINISH_PRECEDENCE: Mapping[FinishReason, int] = {"timeout": 4, "cancelled": 3, "stop": 2, "length": 1, "error": 0}
"""Which reason stands when several apply at the same token, higher first: timeout > cancelled > stop > length >
error. (At different tokens the earliest wins, whatever the reason.)"""


def change_status(seq: Seq, event: StatusEvent, to: Status) -> None:
    """Move ``seq`` to ``to`` on ``event``; ``InvariantViolation`` if the table has no such move.

    The caller names the status it expects to reach, so a phase whose idea of the move disagrees with the table
    fails here rather than leaving a sequence in a queue its status does not name.
    """
    current = seq.status
    if TRANSITIONS.get((current, event)) is not to:
        raise InvariantViolation(
            "status transitions",
            f"{seq.request_id!r}: {current.name} --{event.value}--> {to.name} is not a legal transition",
        )
    seq.status = to
