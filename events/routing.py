"""Which actor each command goes to: the one routing table, shared by the step actor and the simulator.

It is pure data over the command types, so it lives with the vocabulary: ``actors/step.py`` and ``replay/sim.py``
both read it, and neither may import the other. A command type missing from ``ROUTES`` is a ``KeyError`` at
dispatch, never a command silently dropped.
"""

from __future__ import annotations

import enum

from tickloom.events.commands import (
    BindRequest,
    DropSpill,
    EmitTokens,
    Finish,
    Preempted,
    PrefetchSpill,
    ReleaseRequest,
    RunStep,
    SpillOut,
    SwapIn,
    UnwatchDeadline,
    WatchDeadline,
)
from tickloom.events.types import Record


class Actor(enum.Enum):
    """The actors around the core, as far as commands are concerned."""

    DEVICE = "device"
    """The device executor's FIFO: steps, spill copies and swap-in copies run in command order."""
    SPILL = "spill"
    """The spill store (host and disk tiers)."""
    SWAP_IN = "swap_in"
    """The swap-in prefetcher (disk to host)."""
    DEADLINES = "deadlines"
    """The deadline actor's timer table."""
    RETIRE = "retire"
    """The client streams: tokens and finishes."""
    NONE = "none"
    """Informational: logged, sent to no actor (``Preempted``)."""


ROUTES: dict[type[Record], tuple[Actor, ...]] = {
    BindRequest: (Actor.DEVICE,),
    RunStep: (Actor.DEVICE,),
    ReleaseRequest: (Actor.DEVICE,),
    SwapIn: (Actor.DEVICE,),
    # The device copies the KV out in command order and hands the copy to the spill store, which reports
    # ``SpillDone``; the store hears of the spill first so that it is waiting when the copy arrives.
    SpillOut: (Actor.DEVICE, Actor.SPILL),
    DropSpill: (Actor.SPILL,),
    PrefetchSpill: (Actor.SWAP_IN,),
    WatchDeadline: (Actor.DEADLINES,),
    UnwatchDeadline: (Actor.DEADLINES,),
    EmitTokens: (Actor.RETIRE,),
    Finish: (Actor.RETIRE,),
    Preempted: (Actor.NONE,),
}
"""Command type -> the actors it goes to, in order. Every command type has at least one entry."""


def routed_to(*actors: Actor) -> tuple[type[Record], ...]:
    """The command types that go to any of ``actors`` (for ``isinstance`` checks)."""
    return tuple(kind for kind, route in ROUTES.items() if any(actor in route for actor in actors))
