"""The draft-model proposer: a smaller or cheaper model with the target's vocabulary proposes by decoding greedily.

The draft keeps its own paged KV cache and its own block tables, apart from the core's (the core never hears of
them). For each request it remembers the tokens whose KV it holds; a proposal first runs the tokens it has not seen
(the accepted ones since its last proposal, or the whole prompt the first time) as one chunk, then decodes one token
at a time. Tokens that the target rejected are dropped by keeping only the longest common prefix with the request's
tokens, so nothing the draft holds needs to be told about rollbacks, preemption or swaps.

The typical draft is the target's own weights quantized (``EngineConfig.speculative_draft_quant``): int4 weights
drafting for a float32 or bfloat16 model give the full-precision tokens at a cost per accepted token close to the
int4 model's, where a decode step is bound by reading the weights.

A released request's KV stays in the draft's pool, unowned, until the pool needs its blocks (oldest first): a new
request whose tokens begin as a released one's did (a chat template's system prompt, the same document asked
again, the next turn of a conversation) gets a copy of the blocks that hold their common prefix and runs only what
differs, as the target's prefix cache spares the target. A copy, not the blocks themselves: a request that shares
only a system prompt must not take away the rest of a released prompt that a later request may ask again. Without
it the draft ran every prompt whole: on ``tickloom bench speculative``'s prompts the draft's prefills cost about a
sixth of a request's time.

Proposals are greedy whatever the request's temperature (a proposal only decides how many tokens a step yields),
and a function of the tokens and the draft's arithmetic, so a full replay with the same model, dtype and thread
count proposes the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tickloom.engine.model.batch import RowSpec, build_step_batch
from tickloom.engine.model.llama import LlamaModel

MAX_RELEASED = 64
"""Released requests whose KV the draft keeps at most (each new request compares its tokens with every one)."""


@dataclass(slots=True)
class _Draft:
    tokens: list[int] = field(default_factory=list)
    """The tokens whose KV the draft cache holds, position by position."""
    table: list[int] = field(default_factory=list)


class DraftProposer:
    """Proposes with ``model``'s greedy continuation; ``num_blocks`` of ``block_size`` tokens for all requests."""

    name = "draft"

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = 16) -> None:
        self.model = model
        self.block_size = block_size
        self.kv = model.new_kv_cache(num_blocks, block_size)
        self._free = list(range(num_blocks - 1, -1, -1))
        self._drafts: dict[str, _Draft] = {}
        self._released: list[_Draft] = []  # released requests' KV, oldest first
        self._gqa = model.cfg.num_heads // model.cfg.num_kv_heads

    def propose(self, request_id: str, tokens: Sequence[int], most: int) -> list[int]:
        if most <= 0 or not tokens:
            return []
        draft = self._drafts.get(request_id)
        if draft is None:
            draft = self._drafts[request_id] = self._start(tokens)
        keep = _common_prefix(draft.tokens, tokens)
        keep = min(keep, len(tokens) - 1)  # the last token is always run: its logits give the first proposal
        del draft.tokens[keep:]
        if not self._grow(draft, len(tokens) + most - 1):
            return []  # the draft's pool is full: no proposal this time (the row decodes plainly)
        with torch.inference_mode():
            logits = self._forward(draft, keep, list(tokens[keep:]))
            out: list[int] = []
            while True:
                token = int(torch.argmax(logits[-1]).item())
                out.append(token)
                if len(out) == most:
                    return out
                logits = self._forward(draft, len(draft.tokens), [token])

    def release(self, request_id: str) -> None:
        draft = self._drafts.pop(request_id, None)
        if draft is not None:
            self._released.append(draft)
            if len(self._released) > MAX_RELEASED:
                self._free.extend(reversed(self._released.pop(0).table))

    def _start(self, tokens: Sequence[int]) -> _Draft:
        """A new request's draft: holding a copy of the KV of the whole blocks it shares with the released draft
        that shares the most (a block at least), else nothing."""
        best: _Draft | None = None
        shared = 0
        for released in self._released:
            n = _common_prefix(released.tokens, tokens) // self.block_size * self.block_size
            if n > shared:
                best, shared = released, n
        draft = _Draft()
        if best is None or not self._grow(draft, shared, spare=best):
            return draft
        src = torch.tensor(best.table[: len(draft.table)], device=self.model.device)
        dst = torch.tensor(draft.table, device=self.model.device)
        for layer in self.kv.kv:
            layer.index_copy_(1, dst, layer.index_select(1, src))
        draft.tokens = list(tokens[:shared])
        return draft

    def _grow(self, draft: _Draft, positions: int, spare: _Draft | None = None) -> bool:
        """Blocks for ``positions`` in ``draft``'s table, from the free list, then from released drafts, oldest
        first (but ``spare``); False, with nothing taken or dropped, if there are not enough."""
        need = -(-positions // self.block_size) - len(draft.table)
        if need > len(self._free):  # rarely: the released drafts are counted only when the free list falls short
            if need > len(self._free) + sum(len(d.table) for d in self._released if d is not spare):
                return False
            while need > len(self._free):
                oldest = next(i for i, d in enumerate(self._released) if d is not spare)
                self._free.extend(reversed(self._released.pop(oldest).table))
        for _ in range(max(need, 0)):
            draft.table.append(self._free.pop())
        return True

    def _forward(self, draft: _Draft, start: int, tokens: list[int]) -> torch.Tensor:
        row = RowSpec(start, len(tokens), draft.table, True)
        batch = build_step_batch([row], tokens, self.block_size, self._gqa, self.model.device)
        draft.tokens.extend(tokens)
        return self.model.forward(batch, self.kv)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
