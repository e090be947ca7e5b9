"""Commands from the core: the only way a scheduling decision leaves it.

Commands carry deltas. ``BindRequest`` gives the executor a request's sampling parameters once; each ``RunStep``
row carries only its input, its position and the block ids appended since that row's last step. Full block tables
appear only in snapshots. Row data is columnar: parallel lists, never a Struct per row.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from tickloom.events.types import FinishReason, Record, SamplingSpec, Usage

NOT_FED = -1
"""``RunStep.fed_from`` value of a row whose input token is known when the step is planned."""

NO_SAMPLE = -1
"""``RunStep.sample_indices`` value of a row that samples nothing (a prefill chunk before the prompt's end)."""

PROPOSE = -1
"""``RunStep.token_ids`` value of a proposal slot: a position the executor's proposer may fill (speculation)."""


class BindRequest(Record, frozen=True, tag="bind"):
    """Tell the executor how a request samples; sent once, before its first ``RunStep`` row."""

    request_id: str
    params: SamplingSpec
    seed: int
    prompt_len: int
    masked_token_ids: list[int]
    """Token ids masked at sampling while the output index is below ``params.min_tokens``."""
    prompt_token_ids: list[int] = []  # noqa: RUF012 (msgspec copies mutable defaults per instance)
    """The prompt, so that the executor knows the tokens a prefix-cache hit skips (penalties need them)."""


class RunStep(Record, frozen=True, tag="step"):
    """Run one forward step. Row i covers ``num_tokens[i]`` tokens of ``request_ids[i]`` from ``positions[i]``.

    ``token_ids`` is every row's input, concatenated. A row with ``fed_from[i] == t`` takes as input the token
    that step t samples for that request (its slot in ``token_ids`` holds 0). ``sample_indices[i]`` is the output
    index the row samples, or ``NO_SAMPLE``. The executor truncates the request's block table to
    ``block_starts[i]`` entries and appends the row's ``num_new_blocks[i]`` ids from ``new_block_ids``.

    A decode row may end in proposal slots (``PROPOSE``): it reserves those positions (their blocks are in the
    table) for tokens the executor proposes. The executor fills none, some or all of them, samples every filled
    position with its own output index, and reports in ``StepDone.extra_token_ids`` the sampled tokens that
    followed a correct proposal; the KV of the positions after the accepted ones is garbage the core never reads.
    """

    step_id: int
    request_ids: list[str]
    positions: list[int]
    num_tokens: list[int]
    token_ids: list[int]
    fed_from: list[int]
    sample_indices: list[int]
    block_starts: list[int]
    num_new_blocks: list[int]
    new_block_ids: list[int]


class ReleaseRequest(Record, frozen=True, tag="release"):
    """The request has ended: the executor forgets its block table and sampling state."""

    request_id: str


class Preempted(Record, frozen=True, tag="preempt"):
    """A running request was preempted: ``requeue`` drops its KV (recompute later), ``swap`` spills it."""

    request_id: str
    mode: Literal["requeue", "swap"]


class SpillOut(Record, frozen=True, tag="spill"):
    """Copy the first ``num_tokens`` tokens of KV in ``block_ids`` out to the host tier, then forget them."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


class SwapIn(Record, frozen=True, tag="swapin"):
    """Copy a spilled request's KV from the host tier into ``block_ids``; it becomes its new block table."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


class PrefetchSpill(Record, frozen=True, tag="prefetch"):
    """Ask the swap-in actor to bring a spilled request's KV to the host tier (answered by ``SwapInReady``)."""

    request_id: str


class DropSpill(Record, frozen=True, tag="dropspill"):
    """A spilled copy is no longer needed: delete it from every tier."""

    request_id: str


PromptLogprobs = tuple[list[float], list[list[int]], list[list[float]]]
"""One request's prompt logprobs from position 1: each prompt token's logprob, the top-k ids and their logprobs (the
entry of ``LogprobColumns``' three prompt columns for one row, as executors and the retire actor pass it around)."""


class LogprobColumns(NamedTuple):
    """The optional per-token columns that travel with sampled tokens, one entry per token, in the order and with the
    types that ``EmitTokens`` and ``StepDone`` carry them last. The one declaration of that layout for code that
    produces or moves these columns (the oracle, the executors); the wire Structs must spell their fields out, and
    ``tests/test_events_columns.py`` checks that they spell exactly these."""

    logprobs: list[float] | None = None
    """Per entry, the sampled token's logprob; NaN where there is none."""
    top_token_ids: list[list[int]] | None = None
    """Per entry, the top-k alternatives' ids, best first; ``[]`` where there are none."""
    top_logprobs: list[list[float]] | None = None
    """Their logprobs, aligned with ``top_token_ids``."""
    prompt_logprobs: list[list[float]] | None = None
    """Per entry: with a request's output 0, its prompt logprobs from position 1 (``len(prompt) - 1`` entries);
    ``[]`` elsewhere."""
    prompt_top_token_ids: list[list[list[int]]] | None = None
    """Per entry, per prompt position from 1 on: the top-k alternatives' ids (``[]`` as above)."""
    prompt_top_logprobs: list[list[list[float]]] | None = None
    """Their logprobs, aligned with ``prompt_top_token_ids``."""


class EmitTokens(Record, frozen=True, tag="emit"):
    """Tokens to stream: entry i is output token ``token_indices[i]`` of ``request_ids[i]`` (columnar). The last six
    fields are ``LogprobColumns``, as ``StepDone`` reported them."""

    request_ids: list[str]
    token_ids: list[int]
    token_indices: list[int]
    reasoning: list[bool]
    logprobs: list[float] | None = None
    """Per entry, the sampled token's logprob; NaN where there is none."""
    top_token_ids: list[list[int]] | None = None
    """Per entry, the top-k alternatives' ids, best first; ``[]`` where there are none."""
    top_logprobs: list[list[float]] | None = None
    """Their logprobs, aligned with ``top_token_ids``."""
    prompt_logprobs: list[list[float]] | None = None
    """Per entry: on a request's output 0, its prompt logprobs as ``StepDone`` reported them; ``[]`` elsewhere."""
    prompt_top_token_ids: list[list[list[int]]] | None = None
    prompt_top_logprobs: list[list[list[float]]] | None = None


class Finish(Record, frozen=True, tag="finish"):
    """A request ended. Its stream ends after exactly ``usage.completion_tokens`` output tokens."""

    request_id: str
    reason: FinishReason
    usage: Usage
    error: str = ""


class WatchDeadline(Record, frozen=True, tag="watch"):
    """Ask the deadline actor to send ``DeadlineReached`` at ``deadline_ns``."""

    request_id: str
    deadline_ns: int


class UnwatchDeadline(Record, frozen=True, tag="unwatch"):
    """The request ended before its deadline: drop its timer."""

    request_id: str


Command = (
    BindRequest
    | RunStep
    | ReleaseRequest
    | Preempted
    | SpillOut
    | SwapIn
    | PrefetchSpill
    | DropSpill
    | EmitTokens
    | Finish
    | WatchDeadline
    | UnwatchDeadline
)
"""Any command from the core."""

COMMAND_TYPES: tuple[type[Record], ...] = (
    BindRequest,
    RunStep,
    ReleaseRequest,
    Preempted,
    SpillOut,
    SwapIn,
    PrefetchSpill,
    DropSpill,
    EmitTokens,
    Finish,
    WatchDeadline,
    UnwatchDeadline,
)
