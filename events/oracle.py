"""The oracle's token: a pure function of (request seed, output index) that stands in for a model's sampler.

Several rooms must agree on it bit for bit: the stub executor (``engine/model/stub.py``) and the stub device
(``actors/device.py``) produce it, and the simulator's ``OracleExecutor`` (``replay/oracle.py``) produces and checks
it, so that a stub engine's log replays against the oracle. ``events/`` is the one room all of them may import
(like the digest helper, it is a stable hash over the standard library), and the scheduler core never uses it.

**The oracle's logits.** So that logprobs, ``logit_bias`` and ``allowed_token_ids`` mean something on the stub, the
oracle is also a distribution: for (seed, index) a hash picks a start token s, and token t's logit is
``-SPAN * ((t - s) mod V) / V``: 0 for s, falling by ``SPAN / V`` per step round the vocabulary. The oracle's
token is the argmax of these logits plus the biases, over the allowed tokens less ``avoid`` (EOS for the stub
device), ties going to the token nearer s. With no bias and no allowed list that is exactly ``oracle_token``:
the first token from s on that is not avoided. Logprobs are those of this processed distribution (like the real
sampler's, before temperature, which the oracle ignores). Prompt logprobs use the raw logits of a start token
hashed from (the previous prompt token, the position). Every sum has a closed form or runs over the named tokens
only, so the cost is O(k + |bias| + |avoid|) per token, or O(|allowed|) with an allowed list.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Sequence
from typing import NamedTuple

from tickloom.events.commands import LogprobColumns, PromptLogprobs
from tickloom.events.types import SamplingSpec

SPAN = 8.0
"""The oracle's logits lie in (-SPAN, 0]: a bias of +-100 always wins or always loses against them."""


def oracle_start(seed: int, index: int, vocab_size: int) -> int:
    """The token with the oracle's highest logit for output ``index`` of a request with ``seed``."""
    raw = hashlib.blake2b(seed.to_bytes(8, "little", signed=True) + index.to_bytes(8, "little"), digest_size=8)
    return int.from_bytes(raw.digest(), "little") % vocab_size


def oracle_token(seed: int, index: int, vocab_size: int, avoid: Collection[int] = ()) -> int:
    """The oracle's token for output ``index`` of a request with ``seed``; never one of ``avoid``."""
    token = oracle_start(seed, index, vocab_size)
    while token in avoid:
        token = (token + 1) % vocab_size
    return token


def oracle_extra_count(seed: int, index: int, most: int) -> int:
    """How many extra tokens the oracle devices accept after output ``index`` (``OracleExecutor.extras``, the stub
    device's ``extras``): 0 for about two thirds of the rows, else 1 to ``most``; stable per (seed, index)."""
    mixed = (seed * 2654435761 + index * 40503 + 12345) & 0xFFFFFFFF
    count = (mixed >> 11) % (3 * most)
    return count + 1 if count < most else 0


def oracle_accept_count(seed: int, index: int, slots: int) -> int:
    """How many of a row's ``slots`` proposals the oracle devices accept when the row samples output ``index``
    (speculative decoding): 0 to ``slots``, about evenly, stable per (seed, index)."""
    mixed = (seed * 2246822519 + index * 3266489917 + 374761393) & 0xFFFFFFFF
    return (mixed >> 13) % (slots + 1)


def oracle_fill_count(seed: int, index: int, slots: int) -> int:
    """How many of a row's ``slots`` the oracle devices' proposer fills when the row samples output ``index``: at
    least ``oracle_accept_count`` (the filled ones past it were wrong), up to ``slots``, stable per (seed, index).
    A row that accepts none fills none about one time in ``slots + 1``: a proposer that found nothing."""
    accepted = oracle_accept_count(seed, index, slots)
    mixed = (seed * 3266489917 + index * 668265263 + 2654435761) & 0xFFFFFFFF
    return accepted + (mixed >> 9) % (slots - accepted + 1)


class OracleSample(NamedTuple):
    """A token with its logprob and the top-k alternatives (best first) under the oracle's distribution."""

    token: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def _logit(start: int, token: int, vocab_size: int) -> float:
    return -SPAN * ((token - start) % vocab_size) / vocab_size


def _total(vocab_size: int) -> float:
    """The sum of exp(logit) over the whole vocabulary: a geometric series, the same for every start."""
    ratio = math.exp(-SPAN / vocab_size)
    return (1.0 - ratio**vocab_size) / (1.0 - ratio)


def oracle_sample(
    seed: int,
    index: int,
    vocab_size: int,
    avoid: Collection[int] = (),
    *,
    logit_bias: Sequence[tuple[int, float]] = (),
    allowed: Sequence[int] | None = None,
    top_k: int = 0,
    forced: int | None = None,
) -> OracleSample:
    """The oracle's token (or ``forced``, a scripted one) under the biases and masks, with logprobs and top-k.

    A row whose every allowed token is avoided falls back to the allowed tokens, avoided or not (as the real
    sampler falls back to its logits before masks).
    """
    start = oracle_start(seed, index, vocab_size)
    bias = {t: b for t, b in logit_bias if 0 <= t < vocab_size}
    if allowed is not None:
        pool = sorted({t for t in allowed if 0 <= t < vocab_size}) or list(range(vocab_size))
        live = [t for t in pool if t not in avoid] or pool
        scored = [(_logit(start, t, vocab_size) + bias.get(t, 0.0), t) for t in live]
        return _pick(scored, start, vocab_size, math.fsum(math.exp(v) for v, _ in scored), top_k, forced, bias)
    blocked = {t for t in avoid if 0 <= t < vocab_size}
    if len(blocked) >= vocab_size:
        blocked = set()
    special = blocked | set(bias)
    # The tokens without a bias, in logit order, are the ones from ``start`` on: take enough of them.
    plain: list[tuple[float, int]] = []
    t = start
    for _ in range(vocab_size):
        if len(plain) >= max(top_k, 1):
            break
        if t not in special:
            plain.append((_logit(start, t, vocab_size), t))
        t = (t + 1) % vocab_size
    biased = [(_logit(start, t, vocab_size) + b, t) for t, b in bias.items() if t not in blocked]
    total = _total(vocab_size) - math.fsum(math.exp(_logit(start, t, vocab_size)) for t in special)
    total += math.fsum(math.exp(v) for v, _ in biased)
    return _pick(plain + biased, start, vocab_size, total, top_k, forced, bias)


def _pick(scored: list[tuple[float, int]], start: int, vocab_size: int, total: float, top_k: int,
          forced: int | None, bias: dict[int, float]) -> OracleSample:
    """Rank ``scored`` (value, token) by value, then nearness to ``start``; the token and its logprobs."""
    ranked = sorted(scored, key=lambda vt: (-vt[0], (vt[1] - start) % vocab_size))
    log_total = math.log(total) if total > 0.0 else 0.0
    token = ranked[0][1] if forced is None else forced
    value = _logit(start, token, vocab_size) + bias.get(token, 0.0)
    top = ranked[:top_k]
    return OracleSample(token, value - log_total, [t for _, t in top], [v - log_total for v, _ in top])


def oracle_prompt_logprobs(prompt: Sequence[int], vocab_size: int, top_k: int) -> PromptLogprobs:
    """The stub's prompt logprobs: for each position from 1 on, the raw oracle logprob of the prompt's token and the
    top-k tokens, under a start hashed from (the previous token, the position)."""
    log_total = math.log(_total(vocab_size))
    lps: list[float] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    for position in range(1, len(prompt)):
        start = oracle_start(prompt[position - 1], position, vocab_size)
        lps.append(_logit(start, prompt[position], vocab_size) - log_total)
        ids = [(start + j) % vocab_size for j in range(min(top_k, vocab_size))]
        top_ids.append(ids)
        top_lps.append([_logit(start, t, vocab_size) - log_total for t in ids])
    return lps, top_ids, top_lps


class OracleRow(NamedTuple):
    """One sampling row of a step, as the oracle devices see it."""

    seed: int
    output_index: int
    spec: SamplingSpec | None
    prompt: Sequence[int]
    """The request's prompt (needed only when ``spec.prompt_logprobs`` is set)."""
    forced: int | None = None
    """A scripted token, which replaces the oracle's."""


class OracleStep(NamedTuple):
    """A step's sampled tokens, one per sampling row, and their optional columns (``StepDone``'s last six fields)."""

    token_ids: list[int]
    columns: LogprobColumns = LogprobColumns()


def _shapes(spec: SamplingSpec | None) -> bool:
    return spec is not None and (bool(spec.logit_bias) or spec.allowed_token_ids is not None)


def oracle_step(rows: Sequence[OracleRow], vocab_size: int, avoid: Collection[int] = ()) -> OracleStep:
    """Sample every row. As the real sampler does, logprobs come for every row once any row asks for them, top-k
    for the rows that ask; prompt logprobs ride on the row that samples output 0 of a request that asks."""
    wants = any(r.spec is not None and r.spec.logprobs for r in rows)
    tokens: list[int] = []
    lps: list[float] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    for r in rows:
        if not wants and not _shapes(r.spec):
            tokens.append(r.forced if r.forced is not None else oracle_token(r.seed, r.output_index, vocab_size, avoid))
            continue
        spec = r.spec
        sample = oracle_sample(
            r.seed, r.output_index, vocab_size, avoid, forced=r.forced,
            logit_bias=() if spec is None else spec.logit_bias,
            allowed=None if spec is None else spec.allowed_token_ids,
            top_k=0 if spec is None or not spec.logprobs else spec.top_logprobs,
        )
        tokens.append(sample.token)
        lps.append(sample.logprob)
        top_ids.append(sample.top_ids)
        top_lps.append(sample.top_logprobs)
    columns = LogprobColumns(lps, top_ids, top_lps) if wants else LogprobColumns()
    prompts: list[PromptLogprobs] = [
        oracle_prompt_logprobs(r.prompt, vocab_size, r.spec.prompt_logprobs)
        if r.output_index == 0 and r.spec is not None and r.spec.prompt_logprobs is not None else ([], [], [])
        for r in rows
    ]
    if any(p[0] for p in prompts):
        columns = columns._replace(prompt_logprobs=[p[0] for p in prompts],
                                   prompt_top_token_ids=[p[1] for p in prompts],
                                   prompt_top_logprobs=[p[2] for p in prompts])
    return OracleStep(tokens, columns)
