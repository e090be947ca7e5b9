"""Phase 1 of a tick, step results: a finished step's sampled tokens committed through the stop rules (with their
logprobs, the extra tokens a constraint forced or a speculating row verified, and the thinking budget), or a
failed step's rows ended with an error. ``apply.apply_inputs`` calls these in their place in the input order.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized

from tickloom.engine.core.context import TickContext
from tickloom.engine.core.decode_lane import hand_tokens
from tickloom.engine.core.errors import InvariantViolation
from tickloom.engine.core.fences import release_fences
from tickloom.engine.core.finish import mark_finish
from tickloom.engine.core.speculation import drop_proposals, settle_proposals
from tickloom.engine.core.state import CoreState, InflightStep, Seq
from tickloom.engine.core.status import Status
from tickloom.events import DropSpill, StepDone, StepFailed
from tickloom.events.commands import PromptLogprobs


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
