"""Inputs to the core: everything that can change what the scheduler does arrives as one of these.

Tags are pinned short strings; never change one, never reuse one.
"""

from __future__ import annotations

from tickloom.events.types import Record, SamplingSpec


class RequestArrived(Record, frozen=True, tag="arrive"):
    """A client submitted a request. ``seed`` None lets the core assign one; ``deadline_ns`` is absolute."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingSpec
    seed: int | None = None
    priority: int = 0
    deadline_ns: int | None = None
    cache_salt: str = ""


class RequestCancelled(Record, frozen=True, tag="cancel"):
    """The client asked to cancel a request."""

    request_id: str


class ClientGone(Record, frozen=True, tag="gone"):
    """The client stopped reading a request's stream; treated like a cancel."""

    request_id: str


class StepDone(Record, frozen=True, tag="done"):
    """A step finished: one sampled token per sampling row of ``RunStep``, in row order (columnar)."""

    step_id: int
    request_ids: list[str]
    token_ids: list[int]
    step_time_ns: int = 0
    logprobs: list[float] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: list[list[float]] | None = None
    """Per row: on the row that samples output 0 of a request that asked for ``prompt_logprobs``, the logprob of
    each prompt token from position 1 on (``len(prompt) - 1`` entries); ``[]`` on every other row."""
    prompt_top_token_ids: list[list[list[int]]] | None = None
    """Per row, per prompt position from 1 on: the top-k alternatives' ids (``[]`` as above)."""
    prompt_top_logprobs: list[list[list[float]]] | None = None
    """Their logprobs, aligned with ``prompt_top_token_ids``."""
    extra_token_ids: list[list[int]] | None = None
    """Per sampling row: the tokens accepted after the sampled one, in output order; ``[]`` on a row with none.
    None when no row has any. On a row without proposal slots they came without a forward pass of their own (a
    constraint that admits exactly one continuation forces them), and their KV is written by the sequence's next
    row. On a row with proposal slots (speculative decoding) they are the sampled tokens of the positions whose
    proposal was right, at most one per slot; their KV, but for the last one's, is already written."""
    proposed: list[int] | None = None
    """Per sampling row: how many of its proposal slots the proposer filled (0 on a row without slots); at least the
    row's accepted count. None: every slot was filled (the stub devices; logs written before this field). The
    core's adaptive k reads it: a row whose proposer found nothing to propose is no evidence against proposing."""


class StepFailed(Record, frozen=True, tag="fail"):
    """A step raised on the device; its rows (and rows fed from it) end with an error."""

    step_id: int
    error: str


class SpillDone(Record, frozen=True, tag="spilled"):
    """A ``SpillOut`` finished: ``ok`` False means the copy failed and ``error`` says why."""

    request_id: str
    ok: bool
    error: str = ""
    nbytes: int = 0


class SwapInReady(Record, frozen=True, tag="ready"):
    """A swapped request's KV is in the host tier; it may be swapped in."""

    request_id: str


class SwapInFailed(Record, frozen=True, tag="swapfail"):
    """Bringing a swapped request's KV back failed; that request alone ends with an error."""

    request_id: str
    error: str


class StopMatched(Record, frozen=True, tag="stopmatch"):
    """The retire actor matched a stop string ending at output token ``token_index`` (0-based, inclusive)."""

    request_id: str
    token_index: int


class DeadlineReached(Record, frozen=True, tag="deadline"):
    """The deadline actor's timer for a request fired."""

    request_id: str
    deadline_ns: int


class Shutdown(Record, frozen=True, tag="shutdown"):
    """The engine is shutting down: everything still open ends with an error."""

    reason: str = "engine shut down"


Input = (
    RequestArrived
    | RequestCancelled
    | ClientGone
    | StepDone
    | StepFailed
    | SpillDone
    | SwapInReady
    | SwapInFailed
    | StopMatched
    | DeadlineReached
    | Shutdown
)
"""Any input to the core."""

INPUT_TYPES: tuple[type[Record], ...] = (
    RequestArrived,
    RequestCancelled,
    ClientGone,
    StepDone,
    StepFailed,
    SpillDone,
    SwapInReady,
    SwapInFailed,
    StopMatched,
    DeadlineReached,
    Shutdown,
)
