"""Phase 1 of a tick: apply the inputs, in the reference scheduler's order (ARCHITECTURE.md, "The tick").

Arrivals, then cancellations, then step results, then spill and swap-in completions, then stop-string matches,
then deadline notices, then shutdown. Within a kind, inputs apply in the order the step actor logged them.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Sequence, Sized

from tickloom.engine.core.context import TickContext
from tickloom.engine.core.decode_lane import hand_tokens
from tickloom.engine.core.errors import InvariantViolation
from tickloom.engine.core.fences import release_fences
from tickloom.engine.core.finish import mark_finish, track_stops
from tickloom.engine.core.speculation import drop_proposals, may_speculate, settle_proposals
from tickloom.engine.core.state import CoreState, InflightStep, Seq, WaitingQueue, ends_in_thinking
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
from tickloom.events.commands import PromptLogprobs

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


def _step_to_settle(state: CoreState, step_id: int) -> InflightStep:
    if not state.steps or state.steps[0].step_id != step_id:
        expected = state.steps[0].step_id if state.steps else None
        raise InvariantViolation("steps settle in order", f"got a result for step {step_id}, expected {expected}")
    return state.steps.popleft()


def settle_step(state: CoreState, ctx: TickContext, msg: StepDone) -> None:
    """Commit the sampled tokens of a finished step and apply the stop rules.

    Rows of sequences that finished meanwhile (an over-run of running ahead, a cancel, a deadline) are
    discarded: never streamed, never counted.
    """
    step = _step_to_settle(state, msg.step_id)
    if msg.request_ids != step.sampler_ids:
        raise InvariantViolation(
            "step results match their step",
            f"step {msg.step_id} sampled for {step.sampler_ids} but reported {msg.request_ids}",
        )
    if len(msg.token_ids) != len(step.samplers):
        raise InvariantViolation("step results match their step",
                                 f"step {msg.step_id}: {len(msg.token_ids)} tokens for {len(step.samplers)} rows")
    _check_columns(msg)
    state.settled_step = msg.step_id
    _settle_kv(ctx, step)
    extras = msg.extra_token_ids
    if (msg.logprobs is None and msg.top_token_ids is None and msg.prompt_logprobs is None and ctx.plain
            and state.config.think_start_token is None and extras is None and not state.void_rows
            and not state.spec_rows and msg.proposed is None):
        _commit_in_bulk(state, ctx, step, msg)
    else:
        running = Status.RUNNING
        logprobs = msg.logprobs
        for i, seq in enumerate(step.samplers):
            seq.inflight -= 1
            filled = None if msg.proposed is None else msg.proposed[i]
            if seq.spec_row and not seq.inflight:  # no row is planned after a row with proposal slots
                settle_proposals(state, seq, len(extras[i]) if extras is not None else 0, filled)
            elif filled:
                raise InvariantViolation("step results match their step",
                                         f"step {msg.step_id}: {filled} proposals on {seq.request_id!r}'s row, "
                                         f"which has no proposal slots")
            if seq.void:  # a void row is the sequence's earliest in flight: steps settle in order
                seq.void -= 1
                state.void_rows -= 1
                continue
            index = step.sampler_indices[i]
            if seq.status is running:
                _check_index(msg.step_id, seq, index)
                commit_token(state, ctx, seq, msg.token_ids[i], None if logprobs is None else logprobs[i],
                             _top_of(msg, i), _prompt_of(msg, i) if index == 0 and _asks_prompt(seq) else None)
                if extras is not None and extras[i]:
                    _commit_extras(state, ctx, seq, extras[i])
    if extras is not None and any(extras):
        state.lane = None  # the lane derives a step from one token per row
    if state.lane is not None:
        hand_tokens(state.lane, msg.step_id, msg.token_ids)
    release_fences(state, ctx)


def _commit_extras(state: CoreState, ctx: TickContext, seq: Seq, extras: list[int]) -> None:
    """Commit the tokens a step accepted after a row's sampled one, in order, each through the stop rules.

    After a row with proposal slots their KV (but for the last one's) is written, and no row is in flight after it
    (``speculation.settle_proposals`` rolled ``num_computed`` to its end). Otherwise their KV is not written yet:
    the sequence's next row writes them (``catch_up``). A row already in flight
    for it (running ahead, fed from this step) was planned to sample the output the first extra token now is:
    it becomes void, and settles without a token. Its input, the sampled token, is still the right one, so the
    KV it writes is kept.
    """
    running = Status.RUNNING
    committed = 0
    for token in extras:
        if seq.status is not running:
            break
        commit_token(state, ctx, seq, token, None)
        committed += 1
    if seq.status is not running or not committed:
        return
    voided = min(seq.inflight - seq.void, committed)
    seq.void += voided
    state.void_rows += voided
    seq.catch_up = max(0, seq.num_tokens - 1 - seq.num_computed)


def _check_columns(msg: StepDone) -> None:
    """Every optional column of a ``StepDone`` has one entry per sampled token (top-k ids and logprobs alike)."""
    rows = len(msg.token_ids)
    columns = (msg.logprobs, msg.top_token_ids, msg.top_logprobs, msg.prompt_logprobs, msg.prompt_top_token_ids,
               msg.prompt_top_logprobs, msg.extra_token_ids, msg.proposed)
    if any(column is not None and len(column) != rows for column in columns):
        raise InvariantViolation("step results match their step",
                                 f"step {msg.step_id}: a logprob column's length differs from its {rows} tokens")
    if not (_lines_up(msg.top_token_ids, msg.top_logprobs)
            and _lines_up(msg.prompt_top_token_ids, msg.prompt_top_logprobs)):
        raise InvariantViolation("step results match their step",
                                 f"step {msg.step_id}: top-k ids and logprobs do not line up")


def _lines_up(ids: Sequence[Sized] | None, lps: Sequence[Sized] | None) -> bool:
    """Both columns absent, or both present with equal lengths entry by entry."""
    if ids is None or lps is None:
        return ids is None and lps is None
    return all(len(a) == len(b) for a, b in zip(ids, lps, strict=True))


def _top_of(msg: StepDone, row: int) -> tuple[list[int], list[float]] | None:
    """Row ``row``'s top-k alternatives, or None if it has none."""
    ids, lps = msg.top_token_ids, msg.top_logprobs
    if ids is None or lps is None or not ids[row]:
        return None
    return ids[row], lps[row]


def _asks_prompt(seq: Seq) -> bool:
    return seq.params.prompt_logprobs is not None


def _prompt_of(msg: StepDone, row: int) -> PromptLogprobs | None:
    """Row ``row``'s prompt logprobs, or None if it carries none (a one-token prompt has none to carry)."""
    lps = msg.prompt_logprobs
    if lps is None or not lps[row]:
        return None
    ids, tops = msg.prompt_top_token_ids, msg.prompt_top_logprobs
    return lps[row], [] if ids is None else ids[row], [] if tops is None else tops[row]


def _settle_kv(ctx: TickContext, step: InflightStep) -> None:
    running = Status.RUNNING
    for seq, end in zip(step.seqs, step.kv_ends, strict=True):
        seq.kv_settled = end  # rows of a sequence settle in order, each ending past the last
        if seq.has_spill and seq.status is running:
            _drop_spill(ctx, seq)


def _commit_in_bulk(state: CoreState, ctx: TickContext, step: InflightStep, msg: StepDone) -> None:
    """``commit_token`` for a whole step, when no thinking markers are configured and no logprobs travel.

    Committing a token is then an append plus the stop rules, and most rows can stop nothing: their token is
    in no request's stop set (one set test for the whole step) and they are not at their length limit (the
    plan listed the rows that are, ``ending``). So only those candidates go through ``_apply_stop_rules``, in
    row order, after every token is committed: each sequence has one row per step, so no row's outcome
    depends on another's. The sample indices need no check here: the plan derived them from the very outputs
    appended now.
    """
    samplers = step.samplers
    tokens = msg.token_ids
    running = Status.RUNNING
    discarded = False
    for seq, token in zip(samplers, tokens, strict=True):
        seq.inflight -= 1
        if seq.status is running:
            seq.outputs.append(token)
        else:
            discarded = True
    indices = step.sampler_indices
    if not discarded:
        ctx.emit_request_ids += msg.request_ids
        ctx.emit_token_ids += tokens
        ctx.emit_token_indices += indices
        ctx.emit_reasoning += [False] * len(samplers)
    else:
        for i, seq in enumerate(samplers):
            if seq.status is running:
                ctx.emit(msg.request_ids[i], tokens[i], indices[i], False, None)
    candidates = step.ending
    stop_tokens = state.stop_tokens
    if not stop_tokens.isdisjoint(tokens):
        candidates = sorted({*candidates, *(i for i, token in enumerate(tokens) if token in stop_tokens)})
    for i in candidates:
        seq = samplers[i]
        if seq.status is running:
            _apply_stop_rules(state, seq, tokens[i], indices[i])


def _drop_spill(ctx: TickContext, seq: Seq) -> None:
    """A swapped-in sequence's first settled step: its spilled copy is no longer needed."""
    seq.has_spill = False
    ctx.commands.append(DropSpill(seq.request_id))


def _check_index(step_id: int, seq: Seq, index: int) -> None:
    if index != len(seq.outputs):
        raise InvariantViolation(
            "step results match their step",
            f"step {step_id} sampled output {index} of {seq.request_id!r}, which has {len(seq.outputs)} outputs",
        )


def _apply_stop_rules(state: CoreState, seq: Seq, token: int, index: int) -> None:
    """The stop and length rules for output ``index`` (already appended): stop first, then length."""
    config = state.config
    params = seq.params
    count = index + 1
    if count >= params.min_tokens and (
        (not params.ignore_eos and token in config.eos_token_ids) or token in params.stop_token_ids
    ):
        mark_finish(state, seq, "stop", index)
    if count >= params.max_tokens or len(seq.prompt) + count >= config.max_seq_len:
        mark_finish(state, seq, "length", index)


def commit_token(
    state: CoreState,
    ctx: TickContext,
    seq: Seq,
    token: int,
    logprob: float | None,
    top: tuple[list[int], list[float]] | None = None,
    prompt: PromptLogprobs | None = None,
) -> None:
    """Append one sampled token, stream it (with its logprob, top-k alternatives and, on output 0, the prompt
    logprobs), and apply the stop rules and the thinking budget.

    Once the budget is spent, think-end is forced as the next output instead of sampling one. If a row of the
    sequence is in flight, run ahead before the budget ran out (a think-start sampled in the step it is fed
    from), that row's output is the one forced: its sampled token is replaced by think-end when it settles. The
    KV stays consistent either way, since the forced token is fed as the next input.
    """
    config = state.config
    end = config.think_end_token
    budget = seq.params.thinking_budget
    if seq.thinking and budget is not None and seq.thinking_tokens >= budget and end is not None and token != end:
        token, logprob, top = end, None, None
    outputs = seq.outputs
    outputs.append(token)
    index = len(outputs) - 1
    reasoning = seq.thinking
    if config.think_start_token is not None:
        if token == config.think_start_token:
            seq.thinking = reasoning = True
        elif token == end:
            seq.thinking = False
        elif reasoning:
            seq.thinking_tokens += 1
    ctx.emit(seq.request_id, token, index, reasoning, logprob, top, prompt)
    _apply_stop_rules(state, seq, token, index)
    if (
        seq.thinking
        and budget is not None
        and seq.thinking_tokens >= budget
        and seq.status is Status.RUNNING
        and seq.inflight == 0
        and end is not None
    ):
        commit_token(state, ctx, seq, end, None)


def fail_step(state: CoreState, ctx: TickContext, msg: StepFailed) -> None:
    """A failed step ends its rows' requests with an error, and with them the rows of the next step fed from it.

    Blocks whose hashes this step's plan registered hold no trustworthy KV: they leave the prefix cache, and any
    other live request that already shares one ends with an error too.
    """
    step = _step_to_settle(state, msg.step_id)
    state.settled_step = msg.step_id
    state.lane = None
    for seq in step.samplers:
        seq.inflight -= 1
        if not seq.inflight:
            drop_proposals(state, seq)
    error = f"step {msg.step_id} failed: {msg.error}"
    for seq in step.seqs:
        if seq.status is not Status.FINISHED:
            mark_finish(state, seq, "error", len(seq.outputs) - 1, error)
    if step.registered:
        untrusted = set(step.registered)
        for block in step.registered:
            state.pool.unregister(block)
        for seq in list(state.running):
            if seq.status is Status.RUNNING and not untrusted.isdisjoint(seq.block_ids):
                mark_finish(state, seq, "error", len(seq.outputs) - 1, error)
    release_fences(state, ctx)


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
