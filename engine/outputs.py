"""What a client's stream yields: ``RequestOutput`` and ``RequestUsage``, public types of the API room.

A leaf: it imports only msgspec, so the retire actor, which builds the frames, uses it without reaching the API
floor (``tickloom.api``, ``tickloom.asyncio``, ``tickloom.config``, ``tickloom.params``, ``tickloom.runtime``;
``tests/test_rooms.py`` checks it)."""

from __future__ import annotations

import msgspec


class RequestUsage(msgspec.Struct, frozen=True, kw_only=True):
    """Token counts and latencies of a finished request (on its last ``RequestOutput``)."""

    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    time_to_first_token_s: float | None = None
    mean_inter_token_latency_s: float | None = None


class RequestOutput(msgspec.Struct, frozen=True, kw_only=True):
    """One stream frame: the tokens and text produced since the previous frame.

    The last frame of a stream has ``finished=True``, a ``finish_reason`` (``"stop"``, ``"length"``,
    ``"timeout"``, ``"cancelled"`` or ``"error"``) and ``usage``. ``error`` explains an ``"error"`` finish.

    With ``SamplingParams.logprobs=k``, ``logprobs`` holds each token's logprob (NaN where the engine has none, e.g.
    a think-end token forced by the thinking budget) and ``top_logprobs`` one dict per token, token id -> logprob:
    the top-k alternatives best first, then the sampled token if it is not among them (k + 1 entries at most).
    With ``prompt_logprobs=k`` the first frame that carries a token also carries ``prompt_logprobs``: one entry per
    prompt token, None for the first, then dicts shaped like ``top_logprobs``' with the prompt token in place of
    the sampled one. ``index`` is the choice's index among ``SamplingParams.n`` parallel samples.
    """

    request_id: str
    token_ids: list[int]
    text_delta: str = ""
    reasoning_delta: str = ""
    finished: bool = False
    finish_reason: str | None = None
    usage: RequestUsage | None = None
    error: str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    index: int = 0
