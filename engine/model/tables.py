"""What every executor keeps per bound request: its block table, updated from ``RunStep``'s deltas; and the one
reading of a ``RunStep``'s token column that executors compute with (``step_inputs``).

Torch-free, shared by ``ModelExecutor`` and ``StubExecutor`` so the delta rules live in one place. Every executor
(torch, stub, tensor parallel, the full replay's) takes the logged ``RunStep`` itself: ``run_step(step)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from tickloom.events.commands import NOT_FED, PROPOSE, RunStep

FED = -1
"""In ``step_inputs``: "the token this request sampled for this position" (a row fed from a step in flight)."""


def step_inputs(step: RunStep) -> list[int]:
    """The step's token column as executors compute with it: ``FED`` in the slot of each row fed from another
    step (``fed_from``), whose token was not known when the step was planned."""
    tokens = list(step.token_ids)
    offset = 0
    for fed, count in zip(step.fed_from, step.num_tokens, strict=True):
        if fed != NOT_FED:
            tokens[offset] = FED
        offset += count
    return tokens


def proposal_slots(step: RunStep) -> list[int]:
    """Per row, the ``PROPOSE`` slots that end it (speculative decoding): positions the executor's proposer may fill
    after the row's input. A ``PROPOSE`` anywhere else is an error."""
    tokens = step.token_ids
    if PROPOSE not in tokens:
        return [0] * len(step.num_tokens)
    slots: list[int] = []
    offset = 0
    for i, count in enumerate(step.num_tokens):
        n = 0
        while n < count and tokens[offset + count - 1 - n] == PROPOSE:
            n += 1
        if n and (n == count or step.sample_indices[i] < 0 or PROPOSE in tokens[offset : offset + count - n]):
            raise ValueError(f"row {i}: proposal slots must end a sampling row after its input")
        slots.append(n)
        offset += count
    return slots


def step_of(request_ids: Sequence[str], positions: Sequence[int], num_tokens: Sequence[int],
            token_ids: Sequence[int], sample_indices: Sequence[int], block_starts: Sequence[int],
            num_new_blocks: Sequence[int], new_block_ids: Sequence[int], step_id: int = 0) -> RunStep:
    """A ``RunStep`` from columns, a row whose first token is ``FED`` being fed (for tests and benchmarks that drive
    an executor directly; the core plans real steps)."""
    fed_from: list[int] = []
    tokens = list(token_ids)
    offset = 0
    for count in num_tokens:
        fed = count > 0 and tokens[offset] == FED
        fed_from.append(max(step_id - 1, 0) if fed else NOT_FED)  # any step id: only "fed or not" is read
        if fed:
            tokens[offset] = 0
        offset += count
    return RunStep(step_id, list(request_ids), list(positions), list(num_tokens), tokens, fed_from,
                   list(sample_indices), list(block_starts), list(num_new_blocks), list(new_block_ids))


class HasBlockTable(Protocol):
    block_table: list[int]


S = TypeVar("S", bound=HasBlockTable)


class BoundRequests(Generic[S]):
    """Per-request state keyed by request id, for the requests bound and not yet released."""

    def __init__(self, block_size: int) -> None:
        self._requests: dict[str, S] = {}
        self.block_size = block_size
        """Tokens per KV block: each row's table must cover its positions (``start_step`` checks)."""

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def is_bound(self, request_id: str) -> bool:
        return request_id in self._requests

    def block_table(self, request_id: str) -> list[int]:
        return list(self._requests[request_id].block_table)

    def start_step(self, step: RunStep) -> list[S]:
        """Check a ``RunStep``'s columns against each other, then apply its table deltas: each row's table is
        cut to ``block_starts[i]`` entries and its new ids appended. Returns the rows' states."""
        request_ids, positions, num_tokens = step.request_ids, step.positions, step.num_tokens
        token_ids, sample_indices, block_starts = step.token_ids, step.sample_indices, step.block_starts
        num_new_blocks, new_block_ids = step.num_new_blocks, step.new_block_ids
        rows = len(request_ids)
        columns = (positions, num_tokens, step.fed_from, sample_indices, block_starts, num_new_blocks)
        if any(len(column) != rows for column in columns):
            raise ValueError(f"run_step columns of lengths {[len(c) for c in columns]} for {rows} rows")
        if sum(num_tokens) != len(token_ids):
            raise ValueError(f"{len(token_ids)} token ids, rows claim {sum(num_tokens)}")
        if sum(num_new_blocks) != len(new_block_ids):
            raise ValueError(f"{len(new_block_ids)} new block ids, rows claim {sum(num_new_blocks)}")
        states = [self._requests[r] for r in request_ids]
        offset = 0
        for state, start, count in zip(states, block_starts, num_new_blocks, strict=True):
            del state.block_table[start:]
            state.block_table.extend(new_block_ids[offset : offset + count])
            offset += count
        size = self.block_size
        for i, (state, position, count) in enumerate(zip(states, positions, num_tokens, strict=True)):
            need = (position + count + size - 1) // size
            if need > len(state.block_table):
                raise ValueError(f"row {i}: positions up to {position + count - 1} need {need} blocks, "
                                 f"block table has {len(state.block_table)}")
        return states
