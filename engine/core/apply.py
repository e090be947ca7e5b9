"""Phase 1 of a tick: apply the inputs, in the reference scheduler's order (ARCHITECTURE.md, "The tick").

Arrivals, then cancellations, then step results, then spill and swap-in completions, then stop-string matches,
then deadline notices, then shutdown. Within a kind, inputs apply in the order the step actor logged them.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Sequence

from tickloom.engine.core.context import TickContext
from tickloom.engine.core.errors import InvariantViolation
from tickloom.engine.core.finish import mark_finish, track_stops
from tickloom.engine.core.settle import commit_token, fail_step, settle_step
from tickloom.engine.core.speculation import may_speculate
from tickloom.engine.core.state import CoreState, Seq, WaitingQueue, ends_in_thinking
from tickloom.engine.core.status import Status, StatusEvent, change_status
from tickloom.events import (
    ClientGone,
    DeadlineReached,
    DropSpill,
    Finish,
    Input,
    PrefetchSpill,
    RequestArrived,
    RequestCancelled,
    Shutdown,
    SpillDone,
    StepDone,
    StepFailed,
    StopMatched,
    SwapInFailed,
    SwapInReady,
    Usage,
    WatchDeadline,
)

_ORDER: dict[type, int] = {
    RequestArrived: 0,
    RequestCancelled: 1,
    ClientGone: 1,
    StepDone: 2,
    StepFailed: 2,
    SpillDone: 3,
    SwapInReady: 3,
    SwapInFailed: 3,
    StopMatched: 4,
    DeadlineReached: 5,
    Shutdown: 6,
}


def apply_inputs(state: CoreState, ctx: TickContext, inputs: Sequence[Input]) -> None:
    """Apply every input of the tick, grouped by kind in the reference scheduler's order (a stable sort keeps
    log order)."""
    ordered = inputs if len(inputs) <= 1 else sorted(inputs, key=lambda msg: _ORDER[type(msg)])
    for msg in ordered:
        if isinstance(msg, StepDone):
            settle_step(state, ctx, msg)
        elif isinstance(msg, RequestArrived):
            arrive(state, ctx, msg)
        elif isinstance(msg, RequestCancelled | ClientGone):
            cancel(state, msg.request_id)
        elif isinstance(msg, StepFailed):
            fail_step(state, ctx, msg)
        elif isinstance(msg, SpillDone):
            spill_done(state, ctx, msg)
        elif isinstance(msg, SwapInReady):
            seq = state.seqs.get(msg.request_id)
            if seq is not None and seq.status in (Status.SWAPPING, Status.SWAPPED):
                seq.swap_ready = True
                ctx.unblocked = True
        elif isinstance(msg, SwapInFailed):
            seq = state.seqs.get(msg.request_id)
            if seq is not None and seq.status is not Status.FINISHED:
                mark_finish(state, seq, "error", len(seq.outputs) - 1, f"swap-in failed: {msg.error}")
        elif isinstance(msg, StopMatched):
            stop_matched(state, msg)
        elif isinstance(msg, DeadlineReached):
            seq = state.seqs.get(msg.request_id)
            if seq is not None and seq.deadline_ns == msg.deadline_ns:
                # Due now, whatever the clock says: the sweep at the end of this tick times it out.
                heapq.heappush(state.deadlines, (-1, seq.arrival, seq.request_id))
        else:
            shut_down(state, msg)
    ctx.flush_emits()


def _invalid_arrival(state: CoreState, msg: RequestArrived) -> str | None:
    config = state.config
    prompt = msg.prompt_token_ids
    params = msg.params
    if state.shut_down:
        return "the engine is shut down"
    if not prompt:
        return "empty prompt"
    if len(prompt) >= config.max_seq_len:
        return f"prompt of {len(prompt)} tokens does not fit max_seq_len={config.max_seq_len}"
    if min(prompt) < 0 or max(prompt) >= config.vocab_size:
        for position, token in enumerate(prompt):
            if not 0 <= token < config.vocab_size:
                return f"prompt token id {token} at position {position} is outside vocab_size={config.vocab_size}"
    if params.max_tokens < 1:
        return f"max_tokens={params.max_tokens} must be at least 1"
    if not 0 <= params.min_tokens <= params.max_tokens:
        return f"min_tokens={params.min_tokens} must be between 0 and max_tokens={params.max_tokens}"
    if params.thinking_budget is not None and params.thinking_budget < 0:
        return f"thinking_budget={params.thinking_budget} must not be negative"
    vocab = config.vocab_size
    allowed = params.allowed_token_ids
    if allowed is not None:
        if not allowed:
            return "allowed_token_ids is empty: no token could be sampled"
        bad = next((t for t in allowed if not 0 <= t < vocab), None)
        if bad is not None:
            return f"allowed_token_ids contains {bad}, outside vocab_size={vocab}"
    for token, bias in params.logit_bias:
        if not 0 <= token < vocab:
            return f"logit_bias names token {token}, outside vocab_size={vocab}"
        if not math.isfinite(bias):
            return f"logit_bias of token {token} is {bias}, not finite"
    if len(state.waiting) >= config.max_waiting:
        return f"waiting queue is full (max_waiting={config.max_waiting})"
    return None


def derive_seed(request_id: str, arrival: int) -> int:
    """A seed for a request that brought none: stable across processes, unlike ``hash()``."""
    digest = hashlib.blake2b(f"{arrival}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def arrive(state: CoreState, ctx: TickContext, msg: RequestArrived) -> None:
    """Queue a valid arrival by (priority, arrival); answer an invalid one at once with ``Finish(error)``."""
    if msg.request_id in state.seqs:
        raise InvariantViolation("unique request ids", f"request {msg.request_id!r} arrived while still live")
    problem = _invalid_arrival(state, msg)
    if problem is not None:
        usage = Usage(len(msg.prompt_token_ids), 0, 0)
        ctx.commands.append(Finish(msg.request_id, "error", usage, f"request rejected: {problem}"))
        return
    arrival = state.next_arrival
    state.next_arrival += 1
    seed = msg.seed if msg.seed is not None else derive_seed(msg.request_id, arrival)
    seq = Seq(msg.request_id, arrival, msg.priority, list(msg.prompt_token_ids), msg.params, seed,
              msg.deadline_ns, msg.cache_salt)
    seq.thinking = ends_in_thinking(seq.prompt, state.config.think_start_token, state.config.think_end_token)
    if may_speculate(state.config, msg.params):
        seq.spec_k = state.config.speculative_tokens
        seq.spec_retry = 0
    state.seqs[msg.request_id] = seq
    track_stops(state, seq)
    state.waiting.insert(seq)
    if msg.deadline_ns is not None:
        ctx.commands.append(WatchDeadline(msg.request_id, msg.deadline_ns))
        heapq.heappush(state.deadlines, (msg.deadline_ns, arrival, msg.request_id))
    ctx.unblocked = True
    end = state.config.think_end_token
    if seq.thinking and msg.params.thinking_budget == 0 and end is not None and msg.params.prompt_logprobs is None:
        # The prompt leaves the model thinking and the budget allows no thinking token: think-end is output 0,
        # forced as ``commit_token`` forces it after B tokens. The prefill then samples nothing, and think-end is
        # fed as the next input (as after a requeue, the history's last token is pending). A request that asks
        # for prompt logprobs keeps its sampling prefill, which reports them: ``commit_token`` forces think-end
        # over the token it samples.
        commit_token(state, ctx, seq, end, None)


def cancel(state: CoreState, request_id: str) -> None:
    seq = state.seqs.get(request_id)
    if seq is not None:
        mark_finish(state, seq, "cancelled", len(seq.outputs) - 1)


def spill_done(state: CoreState, ctx: TickContext, msg: SpillDone) -> None:
    """A spill finished: prefetch it for swap-in, or on failure fall back to requeue (nothing is lost)."""
    seq = state.seqs.get(msg.request_id)
    if seq is None or seq.status is not Status.SWAPPING:
        return
    if msg.ok:
        change_status(seq, StatusEvent.SPILL_DONE, Status.SWAPPED)
        ctx.commands.append(PrefetchSpill(seq.request_id))
        return
    state.swapping_or_swapped.remove(seq)
    change_status(seq, StatusEvent.SPILL_FAILED, Status.PREEMPTED)
    seq.swap_ready = False
    state.preempted.append(seq)
    ctx.commands.append(DropSpill(seq.request_id))
    seq.has_spill = False
    ctx.unblocked = True


def stop_matched(state: CoreState, msg: StopMatched) -> None:
    """Finish a still-running request as ``stop``, truncated after ``token_index``; ignore a finished one."""
    seq = state.seqs.get(msg.request_id)
    if seq is None:
        return
    if not 0 <= msg.token_index < len(seq.outputs):
        raise InvariantViolation(
            "stop matches name delivered tokens",
            f"{msg.request_id!r} has {len(seq.outputs)} outputs; a stop string matched at {msg.token_index}",
        )
    if mark_finish(state, seq, "stop", msg.token_index):
        del seq.outputs[msg.token_index + 1 :]


def shut_down(state: CoreState, msg: Shutdown) -> None:
    """End every live request with an error that names the state it was in."""
    state.shut_down = True
    where = {
        Status.WAITING: " while waiting",
        Status.RUNNING: "",
        Status.PREEMPTED: " while preempted (requeued for recompute)",
        Status.SWAPPING: " while swapped out",
        Status.SWAPPED: " while swapped out",
    }
    for seq in list(state.seqs.values()):
        if seq.status is not Status.FINISHED:
            mark_finish(state, seq, "error", len(seq.outputs) - 1, f"{msg.reason}{where[seq.status]}",
                        dequeue=False)
    # Every parked request has just finished: empty the queues at once rather than one removal per request.
    state.waiting = WaitingQueue()
    state.preempted = []
    state.swapping_or_swapped = []
    # No step is planned after a shutdown, and ``plan_step`` is where finished rows usually leave ``running``.
    state.prune_running()
