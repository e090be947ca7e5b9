"""Torch-free types shared by the executors (importing this never imports torch). How a request samples is the
wire ``events.SamplingSpec`` itself."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from tickloom.events import Structured


@dataclass(slots=True)
class StepResult:
    """One sampled token per sampling row, in row order, plus optional logprobs (the columns of ``StepDone``)."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_logprobs: list[list[float]] | None = None
    """Per sampling row: on the row sampling output 0 of a request that asks, its prompt logprobs from position 1
    (``events.StepDone.prompt_logprobs``); ``[]`` on other rows."""
    prompt_top_token_ids: list[list[list[int]]] | None = None
    prompt_top_logprobs: list[list[list[float]]] | None = None
    extra_token_ids: list[list[int]] | None = None
    """Per sampling row: tokens a constraint forced after the sampled one (``events.StepDone.extra_token_ids``)."""
    proposed: list[int] | None = None
    """Per sampling row: proposal slots the proposer filled (``events.StepDone.proposed``)."""


@dataclass(slots=True)
class HostKV:
    """A host copy of some blocks' K/V for every layer.

    ``k`` and ``v`` are shaped ``layers x blocks x block_size x kv_heads x head_dim`` (None from the
    stub executor, which holds no tensors).
    """

    k: torch.Tensor | None
    v: torch.Tensor | None
    num_tokens: int
    event: Any = None  # a torch.cuda.Event while an asynchronous device-to-host copy is in flight

    def ready(self) -> bool:
        """True once the copy has landed (always on CPU)."""
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        """Block until the copy has landed."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def nbytes(self) -> int:
        if self.k is None or self.v is None:
            return 0
        return int(self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size())


class PendingMasks(Protocol):
    def wait(self) -> torch.Tensor:
        """The masks, one bool row per requested row (True = allowed), once the worker threads are done."""
        ...


class ConstraintEngine(Protocol):
    """What the executor needs of a grammar engine (``engine.model.structured.Constraints``): a matcher per bound
    request whose state is a pure function of (constraint, output tokens)."""

    def bind(self, request_id: str, spec: Structured) -> None: ...

    def release(self, request_id: str) -> None: ...

    def __contains__(self, request_id: object) -> bool: ...

    def start_masks(self, rows: Sequence[tuple[str, Sequence[int]]]) -> PendingMasks:
        """Start computing each row's mask for the output after the given output tokens, on worker threads."""
        ...

    def forced(self, request_id: str, outputs: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens the constraint forces after ``outputs`` (EOS last when it must end there)."""
        ...
