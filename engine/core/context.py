"""What one tick accumulates while its phases run: commands in order, and the tokens to stream."""

from __future__ import annotations

import attrs

from tickloom.events import Command, EmitTokens


@attrs.define(slots=True, eq=False)
class TickContext:
    """Per-tick scratch state, created by ``SchedulerCore.tick`` and thrown away after it."""

    now_ns: int
    commands: list[Command] = attrs.Factory(list)
    releases: list[Command] = attrs.Factory(list)
    """``ReleaseRequest``s, emitted after the tick's ``RunStep``: a request that ends in the end-of-tick phases
    may still have a row in the step planned earlier in the same tick, and the executor runs commands in order."""
    emit_ids: list[str] = attrs.Factory(list)
    emit_tokens: list[int] = attrs.Factory(list)
    emit_indices: list[int] = attrs.Factory(list)
    emit_reasoning: list[bool] = attrs.Factory(list)
    emit_logprobs: list[float] | None = None
    planned_step: bool = False
    unblocked: bool = False
    lane_broken: bool = False
    """A preemption happened this tick: the plan must not leave a decode lane behind (``engine.core.lane``)."""
    """Something this tick may let parked work run next tick (blocks freed, a resume, an admission)."""

    def emit(self, request_id: str, token: int, index: int, reasoning: bool, logprob: float | None) -> None:
        self.emit_ids.append(request_id)
        self.emit_tokens.append(token)
        self.emit_indices.append(index)
        self.emit_reasoning.append(reasoning)
        if logprob is not None or self.emit_logprobs is not None:
            if self.emit_logprobs is None:
                self.emit_logprobs = [float("nan")] * (len(self.emit_ids) - 1)
            self.emit_logprobs.append(float("nan") if logprob is None else logprob)

    def flush_emits(self) -> None:
        """Append one columnar ``EmitTokens`` for everything committed so far, if anything was."""
        if self.emit_ids:
            self.commands.append(
                EmitTokens(self.emit_ids, self.emit_tokens, self.emit_indices, self.emit_reasoning, self.emit_logprobs)
            )
            self.emit_ids, self.emit_tokens, self.emit_indices, self.emit_reasoning = [], [], [], []
            self.emit_logprobs = None
