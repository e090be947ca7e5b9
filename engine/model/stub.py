"""A model-free executor with ModelExecutor's interface; tokens come from a pure oracle."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tickloom.engine.model.tables import BoundRequests
from tickloom.engine.model.types import HostKV, StepResult
from tickloom.events import SamplingSpec
from tickloom.events.oracle import OracleRow, oracle_step, oracle_token


def token_for(seed: int, output_index: int, vocab_size: int = 32000) -> int:
    """The stub's token for output ``output_index`` of a request with ``seed``: the oracle's (``events.oracle``), so
    a run on this executor and a run of the core's tests agree token for token."""
    return oracle_token(seed, output_index, vocab_size)


@dataclass(slots=True)
class _StubRequest:
    seed: int
    prompt_len: int
    spec: SamplingSpec | None = None
    prompt: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)


class StubExecutor(BoundRequests[_StubRequest]):
    """Same methods as ``ModelExecutor``; no tensors. ``copy_out``/``copy_in`` move no data.

    Its tokens and logprobs are the oracle's (``events.oracle.oracle_step``), biases and allowed tokens applied,
    never one of ``avoid`` (the stub device avoids EOS: pass the same to re-run its logs), so they equal the stub
    device's token for token.
    """

    def __init__(self, vocab_size: int = 32000, num_blocks: int = 1024, block_size: int = 16,
                 avoid: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.avoid = avoid
        self.steps_run = 0

    def bind(
        self,
        request_id: str,
        params: SamplingSpec,
        seed: int,
        prompt_len: int,
        masked_token_ids: list[int],
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._requests[request_id] = _StubRequest(seed, prompt_len, params, list(prompt_token_ids))

    def run_step(
        self,
        request_ids: list[str],
        positions: list[int],
        num_tokens: list[int],
        token_ids: list[int],
        sample_indices: list[int],
        block_starts: list[int],
        num_new_blocks: list[int],
        new_block_ids: list[int],
    ) -> StepResult:
        states = self.start_step(request_ids, positions, num_tokens, token_ids, sample_indices, block_starts,
                                 num_new_blocks, new_block_ids)
        rows = [OracleRow(st.seed, k, st.spec, st.prompt)
                for st, k in zip(states, sample_indices, strict=True) if k >= 0]
        self.steps_run += 1
        return StepResult(*oracle_step(rows, self.vocab_size, self.avoid))

    def copy_out(self, request_id: str, block_ids: list[int], num_tokens: int) -> HostKV:
        if request_id not in self._requests:
            raise KeyError(request_id)
        return HostKV(None, None, num_tokens)

    def copy_in(self, request_id: str, block_ids: list[int], host_kv: HostKV) -> None:
        self._requests[request_id].block_table[:] = list(block_ids)
