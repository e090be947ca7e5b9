"""What every executor keeps per bound request: its block table, updated from ``RunStep``'s deltas.

Torch-free, shared by ``ModelExecutor`` and ``StubExecutor`` so the delta rules live in one place.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar


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

    def start_step(
        self,
        request_ids: list[str],
        positions: list[int],
        num_tokens: list[int],
        token_ids: list[int],
        sample_indices: list[int],
        block_starts: list[int],
        num_new_blocks: list[int],
        new_block_ids: list[int],
    ) -> list[S]:
        """Check a ``RunStep``'s columns against each other, then apply its table deltas: each row's table is
        cut to ``block_starts[i]`` entries and its new ids appended. Returns the rows' states."""
        rows = len(request_ids)
        columns = (positions, num_tokens, sample_indices, block_starts, num_new_blocks)
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
