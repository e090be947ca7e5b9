"""The draft-model proposer: a smaller or cheaper model with the target's vocabulary proposes by decoding greedily.

The draft keeps its own paged KV cache and its own block tables, apart from the core's (the core never hears of
them). For each request it remembers the tokens whose KV it holds; a proposal first runs the tokens it has not seen
(the accepted ones since its last proposal, or the whole prompt the first time) as one chunk, then decodes one token
at a time. Tokens that the target rejected are dropped by keeping only the longest common prefix with the request's
tokens, so nothing the draft holds needs to be told about rollbacks, preemption or swaps.

The typical draft is the target's own weights quantized (``EngineConfig.speculative_draft_quant``): int4 weights
drafting for a float32 or bfloat16 model give the full-precision tokens at a cost per accepted token close to the
int4 model's, where a decode step is bound by reading the weights.

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
        self._gqa = model.cfg.num_heads // model.cfg.num_kv_heads

    def propose(self, request_id: str, tokens: Sequence[int], most: int) -> list[int]:
        if most <= 0 or not tokens:
            return []
        draft = self._drafts.setdefault(request_id, _Draft())
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
            self._free.extend(reversed(draft.table))

    def _grow(self, draft: _Draft, positions: int) -> bool:
        need = -(-positions // self.block_size) - len(draft.table)
        if need > len(self._free):
            return False
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
