"""Fences: a sequence's blocks are freed only once no unsettled step references them.

A step may still be writing KV into the blocks of a sequence that finished or was preempted since it was planned
(running ahead). Such blocks are fenced until the newest step that references them settles, so nothing reuses them
while the device may write them.
"""

from __future__ import annotations

from tickloom.engine.core.context import TickContext
from tickloom.engine.core.state import CoreState, Seq


def is_settled(state: CoreState, seq: Seq) -> bool:
    """No unsettled step references the sequence's blocks."""
    return seq.last_step <= state.settled_step


def release_blocks(state: CoreState, ctx: TickContext, seq: Seq) -> None:
    """Free a sequence's blocks now, or fence them until the newest step that references them settles."""
    if seq.block_ids:
        if is_settled(state, seq):
            state.pool.release(seq.block_ids)
            ctx.unblocked = True
        else:
            state.fences.append((seq.last_step, seq.request_id, seq.block_ids))
    seq.block_ids = []
    seq.sent_blocks = 0


def release_fences(state: CoreState, ctx: TickContext) -> None:
    """Release fenced blocks whose last referencing step has settled."""
    settled = state.settled_step
    if not any(fence[0] <= settled for fence in state.fences):
        return
    kept = [fence for fence in state.fences if fence[0] > settled]
    for step, _, blocks in state.fences:
        if step <= settled:
            state.pool.release(blocks)
    state.fences.clear()
    state.fences.extend(kept)
    ctx.unblocked = True
