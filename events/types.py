"""Shared value types of the vocabulary: sampling parameters, usage and finish reasons.

Every Struct in ``events`` is frozen, ``array_like`` (encoded as a msgpack array, so field order is part of the
schema: append new fields at the end, always with a default) and ``gc=False`` (none can form a cycle).
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "timeout", "cancelled", "error"]
"""Why a request ended. Precedence when several apply at one token: timeout > cancelled > stop > length > error."""

FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "timeout", "cancelled", "error")


class Record(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Base class of every logged Struct."""


class SamplingSpec(Record, frozen=True):
    """How one request samples and stops; the wire form of the public ``SamplingParams``."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str: bool = False
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    thinking_budget: int | None = None
    skip_special_tokens: bool = True
    logit_bias: list[tuple[int, float]] = []
    """(token id, bias) pairs, ids ascending and unique: the bias is added to that token's logit before sampling.
    Pairs, not a map: the log's deterministic encoding takes only str map keys."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be sampled (None: any)."""
    prompt_logprobs: int | None = None
    """None: none; k: each prompt token's logprob (from position 1) and the top-k alternatives, once."""


class Usage(Record, frozen=True):
    """Token counts of a finished request."""

    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0


class CoreGauges(Record, frozen=True):
    """A few state counters, logged with every tick and folded into the digest."""

    waiting: int
    running: int
    preempted: int
    swapped: int
    free_blocks: int
    cached_blocks: int
