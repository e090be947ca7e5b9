"""How a request ends: ``mark_finish`` (the earliest token wins, then precedence) and its stop rule.

A finish takes effect at once (the sequence is no longer scheduled) and is retired at the end of the tick
(``tick_end.retire_finished``). The stop rule is fixed for a request's whole life; ``track_stops`` keeps the set of
tokens that may stop some live request exact, so a step whose tokens miss it stops nothing.
"""

from __future__ import annotations

from tickloom.engine.core.config import CoreConfig
from tickloom.engine.core.state import CoreState, Seq
from tickloom.engine.core.status import FINISH_PRECEDENCE, QUEUE_OF, Status, StatusEvent, change_status
from tickloom.events import FinishReason


def mark_finish(
    state: CoreState, seq: Seq, reason: FinishReason, index: int, error: str = "", dequeue: bool = True
) -> bool:
    """Finish ``seq`` at output ``index`` (-1: before any output); True if this reason is the one that stands.

    Several reasons may arrive in one tick. The earliest token index wins, as the client's stream ends at the
    first terminal condition; at the same index, precedence decides (timeout > cancelled > stop > length >
    error). The sequence stops being scheduled at once and is retired at the end of the tick. With ``dequeue``
    False a parked sequence is left in its queue, for a caller that empties every queue itself (shutdown).
    """
    if seq.finish_reason is not None:
        current = (seq.finish_index, -FINISH_PRECEDENCE[seq.finish_reason])
        if (index, -FINISH_PRECEDENCE[reason]) >= current:
            return False
    else:
        status = seq.status
        change_status(seq, StatusEvent.FINISH, Status.FINISHED)
        if status is Status.RUNNING:
            state.finished_in_running.append(seq)  # it stays in ``running`` until the next prune
        elif not dequeue:
            pass
        elif status is Status.WAITING:
            state.waiting.discard(seq)  # a tombstone: O(1), so a mass cancel is linear
        else:
            getattr(state, QUEUE_OF[status]).remove(seq)
        state.finishing.append(seq)
    seq.finish_reason = reason
    seq.finish_index = index
    seq.finish_error = error
    return True


def stop_rule(config: CoreConfig, seq: Seq) -> tuple[frozenset[int], int]:
    """(tokens that may stop ``seq``, the output count that ends it by length): fixed for its whole life."""
    rule = seq._stop_rule
    if rule is None:
        params = seq.params
        stops = frozenset(params.stop_token_ids) if params.ignore_eos else frozenset(
            (*config.eos_token_ids, *params.stop_token_ids))
        rule = seq._stop_rule = (stops, min(params.max_tokens, config.max_seq_len - len(seq.prompt)))
    return rule


def track_stops(state: CoreState, seq: Seq) -> None:
    """Count a new live request's stop tokens into ``state.stop_tokens``."""
    refs = state.stop_refs
    for token in stop_rule(state.config, seq)[0]:
        count = refs.get(token, 0)
        if not count:
            state.stop_tokens.add(token)
        refs[token] = count + 1


def untrack_stops(state: CoreState, seq: Seq) -> None:
    """Uncount a retired request's stop tokens: a token no live request stops on leaves ``state.stop_tokens``."""
    refs = state.stop_refs
    for token in stop_rule(state.config, seq)[0]:
        count = refs[token] - 1
        if count:
            refs[token] = count
        else:
            del refs[token]
            state.stop_tokens.discard(token)
