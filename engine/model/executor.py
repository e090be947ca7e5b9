"""The device executor: model, paged KV cache and per-request state behind a columnar step API."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tickloom.engine.model.batch import RowSpec, build_step_batch
from tickloom.engine.model.host_pool import CopyEngine
from tickloom.engine.model.kv_cache import HostKV, PagedKVCache
from tickloom.engine.model.llama import LlamaModel
from tickloom.engine.model.sampling import Sampler, SampleRow, has_penalties
from tickloom.engine.model.tables import BoundRequests
from tickloom.engine.model.types import SamplingSpecLike, StepResult


@dataclass(slots=True)
class _RequestState:
    spec: SamplingSpecLike
    seed: int
    prompt_len: int
    masked_token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # token at each position seen or sampled so far


class ModelExecutor(BoundRequests[_RequestState]):
    """Owns the model, its KV blocks and every bound request's state. Not thread-safe: one thread
    (the step actor's executor thread) calls it, in command order."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = 16) -> None:
        super().__init__()
        self.model = model
        self.block_size = block_size
        self.kv: PagedKVCache = model.new_kv_cache(num_blocks, block_size)
        self.sampler = Sampler(model.cfg.vocab_size, model.device)
        self.copier = CopyEngine(model.device)
        self._gqa = model.cfg.num_heads // model.cfg.num_kv_heads

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    def bind(
        self,
        request_id: str,
        params: SamplingSpecLike,
        seed: int,
        prompt_len: int,
        masked_token_ids: list[int],
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        """``prompt_token_ids`` lets rows start past a prefix-cache hit: the skipped tokens are known."""
        state = _RequestState(params, seed, prompt_len, list(masked_token_ids))
        state.tokens.extend(prompt_token_ids)
        self._requests[request_id] = state

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
        """Run one mixed step. A token id below 0 means "the token this request sampled for that
        position" (rows fed from a step still in flight when the command was made)."""
        states = self.start_step(request_ids, positions, num_tokens, token_ids, sample_indices, block_starts,
                                 num_new_blocks, new_block_ids)
        tokens = list(token_ids)
        rows: list[RowSpec] = []
        off = 0
        for i, st in enumerate(states):
            p, n = positions[i], num_tokens[i]
            if len(st.tokens) < p:
                raise ValueError(f"{request_ids[i]}: step starts at {p}, only {len(st.tokens)} tokens known")
            for j in range(off, off + n):
                if tokens[j] < 0:
                    pos = p + j - off
                    if pos >= len(st.tokens):
                        raise ValueError(f"{request_ids[i]}: no sampled token for position {pos}")
                    tokens[j] = st.tokens[pos]
            del st.tokens[p:]
            st.tokens.extend(tokens[off : off + n])
            rows.append(RowSpec(p, n, st.block_table, sample_indices[i] >= 0))
            off += n
        batch = build_step_batch(rows, tokens, self.block_size, self._gqa, self.model.device)
        self.copier.before_compute()
        logits = self.model.forward(batch, self.kv)
        sample_rows: list[SampleRow] = []
        for i, st in enumerate(states):
            k = sample_indices[i]
            if k < 0:
                continue
            end = positions[i] + num_tokens[i]
            sample_rows.append(
                SampleRow(
                    spec=st.spec,
                    seed=st.seed,
                    output_index=k,
                    prompt_tokens=st.tokens[: st.prompt_len] if has_penalties(st.spec) else [],
                    output_tokens=st.tokens[st.prompt_len : end] if has_penalties(st.spec) else [],
                    masked_token_ids=st.masked_token_ids,
                )
            )
        out = self.sampler.sample(logits, sample_rows)
        t_i = 0
        for i, st in enumerate(states):
            if sample_indices[i] < 0:
                continue
            st.tokens.append(out.token_ids[t_i])
            t_i += 1
        return StepResult(out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs)

    def copy_out(self, request_id: str, block_ids: list[int], num_tokens: int) -> HostKV:
        """A host copy of these blocks' K/V for all layers. On CUDA the copy is asynchronous into
        pinned memory; call ``HostKV.wait()`` (or ``ready()``) before reading it."""
        if request_id not in self._requests:
            raise KeyError(request_id)
        return self.copier.copy_out(self.kv, block_ids, num_tokens)

    def copy_in(self, request_id: str, block_ids: list[int], host_kv: HostKV) -> None:
        """Write a host copy back into (possibly different) device blocks; the request's block
        table becomes ``block_ids``."""
        st = self._requests[request_id]
        if host_kv.k is None or host_kv.v is None:
            raise ValueError("host KV holds no tensors")
        self.copier.copy_in(self.kv, block_ids, host_kv)
        st.block_table[:] = list(block_ids)

