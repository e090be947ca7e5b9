"""Proposers for speculative decoding, and the rule that accepts a row's proposals.

The core reserves proposal slots at the end of a decode row (``RunStep``'s ``PROPOSE`` entries); the executor asks
its proposer for up to that many tokens, runs the row's input and the proposals as consecutive decode rows of the
same request (each at its own position, so each position is computed exactly as a plain decode row would compute
it), samples every position with its own output index, and keeps the longest prefix of proposals that equal the
sampled tokens (``accepted``). Since a token is a pure function of the logits and (seed, output index), the tokens
are the ones decoding without speculation gives: a proposal only decides how many of them one step produces.

A proposer sees only the request's tokens (prompt and outputs so far), never the logits, so a replay that runs the
same proposer over the same tokens proposes the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol


class Proposer(Protocol):
    """Proposes the next tokens of a request from its tokens so far."""

    name: str

    def propose(self, request_id: str, tokens: Sequence[int], most: int) -> list[int]:
        """At most ``most`` tokens to follow ``tokens`` (the request's prompt and outputs, the row's input last)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget the request."""
        ...


def accepted(proposed: Sequence[int], sampled: Sequence[int]) -> int:
    """How many proposals to keep: ``sampled[j]`` is the token sampled at the position whose input was the row's
    input (j = 0) or ``proposed[j - 1]``; proposal ``j`` stands while it equals ``sampled[j]``."""
    n = 0
    while n < len(proposed) and proposed[n] == sampled[n]:
        n += 1
    return n


@dataclass(slots=True)
class _Index:
    tokens: list[int] = field(default_factory=list)
    """The tokens indexed so far (a copy): a request whose tokens changed before ``end`` is indexed again."""
    end: int = 0
    """n-grams ending before this position are indexed (each has a following token)."""
    grams: dict[tuple[int, ...], int] = field(default_factory=dict)
    """n-gram -> the position after its latest occurrence."""


class PromptLookup:
    """Prompt lookup decoding: find the request's last ``n`` tokens earlier in its prompt or output (the longest
    ``n`` from ``max_n`` down to ``min_n`` that occurs, its latest occurrence), and propose what followed it there:
    up to ``most`` tokens, or up to ``short_most`` when only ``n`` = 1 matched.

    It pays where the output copies its input (summaries, edits, extraction, code). Each request's n-grams are
    indexed incrementally, so a proposal costs O(new tokens), not O(history).

    Why a one-token match proposes one token: a single token recurs often by chance, so what followed it is a weak
    guess, but a step verifies one proposal for almost nothing (at batch 1 a step of two rows costs about 4% more
    than a step of one: both read every weight once), and in a copied passage that one right token makes the next
    match a long one. Proposing ``most`` tokens after such a match spent a step of ``most + 1`` rows (1.6x a
    plain step's time at k = 4) on mostly wrong guesses, and each all-wrong row halves the sequence's k.
    Measured on ``tickloom bench speculative``'s copy-heavy prompts at batch 1: min_n 2, 1.59x; min_n 1 proposing
    ``most``, 1.80x; min_n 1 proposing one, 1.97x (open-ended prompts 1.10-1.18x in all three).
    """

    name = "prompt_lookup"

    def __init__(self, max_n: int = 3, min_n: int = 1, short_most: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if short_most < 0:
            raise ValueError(f"prompt lookup needs short_most >= 0, got {short_most}")
        self.max_n, self.min_n, self.short_most = max_n, min_n, short_most
        self._index: dict[str, _Index] = {}

    def propose(self, request_id: str, tokens: Sequence[int], most: int) -> list[int]:
        length = len(tokens)
        if most <= 0 or length < self.min_n + 1:
            return []
        index = self._index.get(request_id)
        if index is None or index.tokens[: index.end + 1] != list(tokens[: index.end + 1]):
            index = self._index[request_id] = _Index()
        grams = index.grams
        for stop in range(index.end, length - 1):  # the n-grams ending at ``stop``, each followed by a token
            for n in range(self.min_n, self.max_n + 1):
                if stop + 1 >= n:
                    grams[tuple(tokens[stop + 1 - n : stop + 1])] = stop + 1
        index.end = max(index.end, length - 1)
        index.tokens = list(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            after = grams.get(tuple(tokens[length - n :]))
            if after is not None:
                return list(tokens[after : after + (most if n > 1 else min(most, self.short_most))])
        return []

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)


PROPOSERS = ("prompt_lookup", "draft")
"""The proposer names ``EngineConfig.speculative_proposer`` accepts."""


class ProposerSetting(NamedTuple):
    """What builds a proposer (``EngineConfig``'s speculative fields, as a log's header records them)."""

    name: str
    draft_model: str | None = None
    """The draft proposer's model (None: the target's own)."""
    draft_quant: str = "int4"


def make_proposer(setting: ProposerSetting | str, *, target: str = "", target_vocab: int | None = None,
                  dtype: str | None = None, device: str | None = None, num_blocks: int = 0,
                  block_size: int = 16) -> Proposer:
    """The proposer ``setting`` names. A draft model is loaded (``target`` is the target's name or path, used when
    the setting names no draft model); its vocabulary must be the target's, ``target_vocab``."""
    if isinstance(setting, str):
        setting = ProposerSetting(setting)
    if setting.name == "prompt_lookup":
        return PromptLookup()
    if setting.name != "draft":
        raise ValueError(f"unknown speculative proposer {setting.name!r}; choose one of {list(PROPOSERS)}")
    from tickloom.engine.model.draft import DraftProposer
    from tickloom.engine.model.loaders import load_model

    name = setting.draft_model or target
    if not name:
        raise ValueError("the draft proposer needs a draft model (or the target's name to quantize)")
    loaded = load_model(name, dtype=dtype, device=device, quant=setting.draft_quant)
    if target_vocab is not None and loaded.config.vocab_size != target_vocab:
        raise ValueError(f"the draft model {name!r} has {loaded.config.vocab_size} tokens, the target "
                         f"{target_vocab}: a draft must share the target's vocabulary")
    return DraftProposer(loaded.model, max(num_blocks, 1), block_size)
