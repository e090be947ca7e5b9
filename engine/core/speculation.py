"""Speculative decoding as the core sees it: which requests propose, how many proposal slots a decode row gets, and
what a settled row's accepted count does to its sequence.

The core never sees a proposal. It reserves slots at the end of a decode row (``PROPOSE`` in ``RunStep.token_ids``:
positions whose blocks are in the row's table, counted in the token budget). The executor's proposer fills none,
some or all of them, the step samples every filled position with its own output index, and the sampled tokens that
followed a right proposal come back as the row's extra tokens (``StepDone.extra_token_ids``). Their number, the
accepted count, is therefore logged with the step, and the core replays without the model or the proposer.

**Running ahead.** No row is fed from a row with slots: how many tokens it yields, and so the next row's position,
is unknown until it settles (``planner.can_run_ahead``). A speculating sequence runs one row per settled step, each
yielding one token plus the accepted ones; a sequence that has stopped proposing runs ahead again. A row with slots
may itself be fed from a plain row in flight: the executor proposes when it runs the row, by then knowing the fed
token. (The alternative, planning the next row as if no proposal were accepted and voiding it when some were, would
spend a row of compute per accepted proposal and plan most rows at a wrong position.)

**Rejected positions.** Their KV was written with wrong tokens. Settling rolls ``num_computed`` and ``kv_settled``
back to the verified end, so the sequence's next row overwrites them, the prefix cache (which is offered settled
positions only) never registers them, and a spill copies only verified KV. The blocks stay in the table.

**Adaptive k.** A row whose every slot was accepted doubles the sequence's ``spec_k`` (up to
``speculative_tokens``); a row that proposed and accepted none halves it. At 0 the sequence decodes plainly, with
running ahead, for ``RETRY_AFTER`` outputs, then proposes one slot again. So speculation costs little where it does
not pay: a rejected slot costs a position of compute and of token budget, and the running ahead its row gave up. A
row whose proposer filled no slot (``StepDone.proposed``: prompt lookup found no earlier occurrence of the last
tokens) leaves ``spec_k`` as it is. It cost no compute, only the row's running ahead, and it says nothing about
the next row: in a copied text a passage with no match is followed by one with a long match. (Counting it as a
rejection turned speculation off for most of each copy-heavy request: 101 of 133 decode steps ran one row, and
leaving k alone took batch 1 on copy-heavy prompts from 1.39x to 1.64x.)

**Only at small batches.** While more than ``speculative_max_running`` sequences run, no row gets slots: a step of
many rows keeps the device busy anyway, and the rows a proposal adds cost compute that a batch no longer has to
spare. On the CPU kernels a step of more than about four rows is bound by arithmetic: with four sequences
speculating, open-ended prompts ran at 0.84x of plain decoding, hence the default of 2. (``running`` is pruned
before the decode rows are planned, so the count is the running sequences'.)

Requests whose tokens depend on more than the logits of their own position do not propose: a structured-output
constraint (its forced tokens are extra tokens of their own), logprobs (extra tokens carry none) and a thinking
budget (which may replace a token after its KV is written).
"""

from __future__ import annotations

from tickloom.engine.core.config import CoreConfig
from tickloom.engine.core.errors import InvariantViolation
from tickloom.engine.core.finish import stop_rule
from tickloom.engine.core.state import CoreState, Seq
from tickloom.events import SamplingSpec

RETRY_AFTER = 16
"""Outputs a sequence decodes without proposing once its rows stopped accepting, before it tries one slot again."""


def may_speculate(config: CoreConfig, params: SamplingSpec) -> bool:
    """Whether a request's decode rows may carry proposal slots (see the module docstring)."""
    return (config.speculative_tokens > 0 and params.structured is None and not params.logprobs
            and params.thinking_budget is None)


def plan_slots(state: CoreState, seq: Seq, position: int, index: int, token_budget: int) -> int:
    """Slots for ``seq``'s decode row at ``position`` sampling output ``index``; grows its table to hold them.

    ``token_budget`` counts the row's own token. The slots never run past the length limit (an accepted token there
    would be discarded) nor take a block the free list cannot spare: speculation never reclaims a cached block, and
    leaves a free block for every running sequence, so that it does not drive another row into preemption. Call
    after the row's own block is ensured.
    """
    if len(state.running) > state.config.speculative_max_running:
        return 0
    k = seq.spec_k
    if k == 0:
        if seq.spec_retry < 0 or len(seq.outputs) < seq.spec_retry:
            return 0
        k = seq.spec_k = 1
    if seq.void:
        return 0
    slots = min(k, token_budget - 1, stop_rule(state.config, seq)[1] - index - 1)
    if slots <= 0:
        return 0
    block_size = state.config.block_size
    table = seq.block_ids
    need = (position + slots) // block_size + 1 - len(table)
    if need > 0:
        pool = state.pool
        if pool.num_free - need >= len(state.running):  # a free block left for every running sequence's next row
            table.extend(pool.allocate(need))
        else:
            slots = len(table) * block_size - 1 - position
    return max(slots, 0)


def settle_proposals(state: CoreState, seq: Seq, accepted: int, filled: int | None = None) -> None:
    """Its row with slots settled with ``accepted`` extra tokens of ``filled`` proposals (None: every slot
    filled): roll its KV back to the verified end and adapt its ``spec_k``. Runs before the row's tokens are
    committed, whatever the sequence's status."""
    slots = seq.spec_row
    filled = slots if filled is None else filled
    if not accepted <= filled <= slots:
        raise InvariantViolation(
            "step results match their step",
            f"{seq.request_id!r}: {accepted} proposals accepted of {filled} proposed on a row with {slots} "
            f"proposal slots",
        )
    seq.spec_row = 0
    state.spec_rows -= 1
    verified = seq.num_computed - slots + accepted
    seq.num_computed = seq.kv_settled = verified
    if accepted == slots:
        seq.spec_k = min(2 * seq.spec_k, state.config.speculative_tokens)
    elif accepted == 0 and filled > 0:
        seq.spec_k //= 2
        if seq.spec_k == 0:
            seq.spec_retry = len(seq.outputs) + RETRY_AFTER


def drop_proposals(state: CoreState, seq: Seq) -> None:
    """Its row with slots belonged to a failed step: nothing was accepted, nothing is known."""
    if seq.spec_row:
        seq.spec_row = 0
        state.spec_rows -= 1
