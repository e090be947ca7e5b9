"""What one tick accumulates while its phases run: commands in order, and the tokens to stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from tickloom.events import Command, EmitTokens
from tickloom.events.commands import PromptLogprobs

_NAN = float("nan")


def _column(column: list[Any] | None, filled: int, blank: Callable[[], Any], value: Any) -> list[Any]:
    """``column`` with ``value`` appended; created on first use, with ``blank()`` for the ``filled`` entries before."""
    if column is None:
        column = [blank() for _ in range(filled)]
    column.append(value)
    return column


def _no_prompt() -> PromptLogprobs:
    return [], [], []


@attrs.define(slots=True, eq=False)
class TickContext:
    """Per-tick scratch state, created by ``SchedulerCore.tick`` and thrown away after it.

    The columns of the ``EmitTokens`` being built are named ``emit_`` and its field's name, and stay aligned with
    ``emit_request_ids``. The optional ones (logprobs, top-k, prompt logprobs) are None until an entry has a value;
    then they are created padded for the entries before it (NaN for a logprob, ``[]`` for a list), and every later
    entry appends to them, with its value or that blank.
    """

    commands: list[Command] = attrs.Factory(list)
    releases: list[Command] = attrs.Factory(list)
    """``ReleaseRequest``s, emitted after the tick's ``RunStep``: a request that ends in the end-of-tick phases
    may still have a row in the step planned earlier in the same tick, and the executor runs commands in order."""
    emit_request_ids: list[str] = attrs.Factory(list)
    emit_token_ids: list[int] = attrs.Factory(list)
    emit_token_indices: list[int] = attrs.Factory(list)
    emit_reasoning: list[bool] = attrs.Factory(list)
    emit_logprobs: list[float] | None = None
    emit_top_token_ids: list[list[int]] | None = None
    emit_top_logprobs: list[list[float]] | None = None
    emit_prompt: list[PromptLogprobs] | None = None
    """Per entry, its prompt logprobs or ``([], [], [])``; split into three columns when flushed."""
    planned_step: bool = False
    unblocked: bool = False
    """Something this tick may let parked work run next tick (blocks freed, a resume, an admission)."""
    lane_broken: bool = False
    """A preemption happened this tick: the plan must not leave a decode lane behind (``engine.core.decode_lane``)."""

    @property
    def plain(self) -> bool:
        """No optional column has been started: entries may be appended to the four plain columns in bulk."""
        return self.emit_logprobs is None and self.emit_top_token_ids is None and self.emit_prompt is None

    def emit(
        self,
        request_id: str,
        token: int,
        index: int,
        reasoning: bool,
        logprob: float | None,
        top: tuple[list[int], list[float]] | None = None,
        prompt: PromptLogprobs | None = None,
    ) -> None:
        """Stream one token; ``top`` is its (ids, logprobs) alternatives, ``prompt`` its request's prompt logprobs."""
        before = len(self.emit_request_ids)
        self.emit_request_ids.append(request_id)
        self.emit_token_ids.append(token)
        self.emit_token_indices.append(index)
        self.emit_reasoning.append(reasoning)
        if logprob is not None or self.emit_logprobs is not None:
            if self.emit_logprobs is None:
                self.emit_logprobs = [_NAN] * before
            self.emit_logprobs.append(_NAN if logprob is None else logprob)
        if top is not None or self.emit_top_token_ids is not None:
            ids, lps = ([], []) if top is None else top
            self.emit_top_token_ids = _column(self.emit_top_token_ids, before, list, ids)
            self.emit_top_logprobs = _column(self.emit_top_logprobs, before, list, lps)
        if prompt is not None or self.emit_prompt is not None:
            self.emit_prompt = _column(self.emit_prompt, before, _no_prompt, _no_prompt() if prompt is None else prompt)

    def flush_emits(self) -> None:
        """Append one columnar ``EmitTokens`` for everything committed so far, if anything was."""
        if self.emit_request_ids:
            prompt = self.emit_prompt
            self.commands.append(
                EmitTokens(
                    request_ids=self.emit_request_ids,
                    token_ids=self.emit_token_ids,
                    token_indices=self.emit_token_indices,
                    reasoning=self.emit_reasoning,
                    logprobs=self.emit_logprobs,
                    top_token_ids=self.emit_top_token_ids,
                    top_logprobs=self.emit_top_logprobs,
                    prompt_logprobs=None if prompt is None else [p[0] for p in prompt],
                    prompt_top_token_ids=None if prompt is None else [p[1] for p in prompt],
                    prompt_top_logprobs=None if prompt is None else [p[2] for p in prompt],
                )
            )
            self.emit_request_ids, self.emit_token_ids, self.emit_token_indices, self.emit_reasoning = [], [], [], []
            self.emit_logprobs = self.emit_top_token_ids = self.emit_top_logprobs = None
            self.emit_prompt = None
