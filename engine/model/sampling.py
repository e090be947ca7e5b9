"""Counter-based sampling: a token's noise is a pure function of (seed, output index, token id).

Every row is processed with batched torch ops. Because the noise never depends on generator state or
on the other rows, a request's tokens are the same alone, in any batch, after preemption or a re-run.

Order of operations per row: penalties, ``logit_bias``, the ``allowed_token_ids`` mask, a structured-output
constraint's mask, the ``min_tokens`` logit mask, logprobs (of this processed distribution, before temperature),
then greedy argmax (temperature 0) or temperature, top-k, top-p, min-p and Gumbel-max over the hash noise. So greedy
picks the argmax after the bias and the masks. A temperature below ``MIN_TEMPERATURE`` is greedy. Every row is
``sanitize``d, so no accepted parameter value can produce NaN or fail another row of the batch; a row that the masks
leave with no token (its allowed tokens are all EOS or stop tokens while ``min_tokens`` masks them) falls back to
its raw logits restricted to its allowed tokens (and its constraint's), so a sampled token is always an allowed one:
a complete constraint allows only EOS, which ``min_tokens`` may mask; the row then still samples EOS.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tickloom.events import SamplingSpec

MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D  # odd multipliers below 2**31, so int64 products never overflow
_M2 = 0x4C957F2D
_MASK64 = (1 << 64) - 1
MIN_TEMPERATURE = 1e-5
"""Below this a temperature samples greedily (as vLLM does): dividing by it would overflow the logits."""


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_key(seed: int, output_index: int) -> int:
    """A 32-bit key for one (seed, output index) pair; pure Python integer arithmetic."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (output_index & _MASK64)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix on int64 tensors holding values below 2**32."""
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def token_hashes(vocab_size: int, device: torch.device) -> torch.Tensor:
    """Per-token pre-mix, computed once per vocabulary."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return _mix32((ids * 0x9E3779B1) & MASK32)


def gumbel_noise(keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """``rows x vocab`` standard Gumbel noise (float64) for row keys (int64, below 2**32)."""
    x = _mix32(vocab_hash.unsqueeze(0) ^ keys.unsqueeze(1))
    x = _mix32(x ^ ((keys.unsqueeze(1) * 0x2545F491) & MASK32))
    u = (x.double() + 0.5) * (1.0 / 4294967296.0)
    return -torch.log(-torch.log(u))


@dataclass(slots=True)
class SampleRow:
    """Sampling inputs of one row: its parameters and the token history needed for penalties."""

    spec: SamplingSpec
    seed: int
    output_index: int
    prompt_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    masked_token_ids: list[int] = field(default_factory=list)
    allowed: torch.Tensor | None = None
    """A structured-output constraint's mask (bool, one entry per token, True = allowed), applied with
    ``allowed_token_ids``; None: unconstrained."""


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float] | None
    top_token_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None


def has_penalties(spec: SamplingSpec) -> bool:
    return spec.repetition_penalty != 1.0 or spec.presence_penalty != 0.0 or spec.frequency_penalty != 0.0


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition (prompt and output tokens), presence and frequency (output tokens) penalties."""
    idx = [i for i, r in enumerate(rows) if has_penalties(r.spec)]
    if not idx:
        return logits
    dev = logits.device
    v = logits.shape[1]
    sub = logits[idx]
    counts = torch.zeros((len(idx), v), dtype=logits.dtype, device=dev)
    seen = torch.zeros((len(idx), v), dtype=torch.bool, device=dev)
    for j, i in enumerate(idx):
        out = rows[i].output_tokens
        if out:
            t = torch.tensor(out, dtype=torch.long, device=dev)
            counts[j].index_add_(0, t, torch.ones(len(out), dtype=logits.dtype, device=dev))
        if rows[i].prompt_tokens:
            seen[j, torch.tensor(rows[i].prompt_tokens, dtype=torch.long, device=dev)] = True
    seen |= counts > 0

    def col(name: str) -> torch.Tensor:
        vals = [float(getattr(rows[i].spec, name)) for i in idx]
        return torch.tensor(vals, dtype=logits.dtype, device=dev).unsqueeze(1)

    rep = col("repetition_penalty")
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    sub = sub - col("frequency_penalty") * counts - col("presence_penalty") * (counts > 0).to(sub.dtype)
    logits = logits.clone()
    logits[idx] = sub
    return logits


def apply_min_tokens_mask(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Forbid a row's ``masked_token_ids`` (e.g. stop tokens) while its output index < min_tokens."""
    r_idx: list[int] = []
    t_idx: list[int] = []
    v = logits.shape[1]
    for i, r in enumerate(rows):
        if r.output_index < r.spec.min_tokens and r.masked_token_ids:
            masked = [t for t in r.masked_token_ids if 0 <= t < v]  # an id outside the vocabulary masks nothing
            r_idx.extend([i] * len(masked))
            t_idx.extend(masked)
    if not r_idx:
        return logits
    logits = logits.clone()
    dev = logits.device
    logits[torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Add each row's ``logit_bias`` to its tokens' logits (ids outside the vocabulary are ignored)."""
    r_idx: list[int] = []
    t_idx: list[int] = []
    bias: list[float] = []
    v = logits.shape[1]
    for i, r in enumerate(rows):
        for token, b in r.spec.logit_bias:
            if 0 <= token < v:
                r_idx.append(i)
                t_idx.append(token)
                bias.append(float(b))
    if not r_idx:
        return logits
    dev = logits.device
    logits = logits.clone()
    logits.index_put_((torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
                      torch.tensor(bias, dtype=logits.dtype, device=dev), accumulate=True)
    return logits


def apply_allowed_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Set every token outside a row's ``allowed_token_ids`` to -inf (rows without the list are untouched)."""
    limited = [i for i, r in enumerate(rows) if r.spec.allowed_token_ids is not None]
    if not limited:
        return logits
    dev = logits.device
    v = logits.shape[1]
    keep = torch.zeros((len(limited), v), dtype=torch.bool, device=dev)
    for j, i in enumerate(limited):
        allowed = [t for t in rows[i].spec.allowed_token_ids or () if 0 <= t < v]
        if allowed:
            keep[j, torch.tensor(allowed, dtype=torch.long, device=dev)] = True
        else:  # nothing inside the vocabulary: the list restricts nothing
            keep[j] = True
    idx = torch.tensor(limited, device=dev)
    logits = logits.clone()
    logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))
    return logits


def apply_constraint_masks(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Set every token a row's constraint forbids (``SampleRow.allowed``) to -inf."""
    masked = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not masked:
        return logits
    dev = logits.device
    v = logits.shape[1]
    keep = torch.stack([_widen(rows[i].allowed, v) for i in masked]).to(dev)  # type: ignore[arg-type]
    idx = torch.tensor(masked, device=dev)
    logits = logits.clone()
    logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))
    return logits


def _widen(allowed: torch.Tensor, width: int) -> torch.Tensor:
    """A mask as wide as the logits: tokens past the mask's end are forbidden."""
    if allowed.shape[0] >= width:
        return allowed[:width]
    return torch.cat([allowed, allowed.new_zeros(width - allowed.shape[0])])


def sanitize(logits: torch.Tensor, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """Make any row safe to sample from: NaN becomes -inf, +inf the largest finite value, and a row left with no
    finite value takes its ``fallback`` row (the logits before penalties and masks), or zeros.

    A no-op (no copy) on the usual rows: finite values, some of them -inf. Extreme but accepted parameters (a
    huge repetition penalty, a stop-token mask over the whole vocabulary) then affect only their own row and
    never yield NaN, which would make a token arbitrary and a logprob unequal to itself in a replay.
    """
    finite = torch.isfinite(logits)
    if bool(finite.all()):
        return logits
    if bool((logits.isnan() | (logits == float("inf"))).any()):
        top = torch.finfo(logits.dtype).max
        logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=top, neginf=float("-inf"))
        finite = torch.isfinite(logits)
    dead = ~finite.any(dim=-1)
    if bool(dead.any()):
        logits = logits.clone()
        if fallback is not None:
            logits[dead] = sanitize(fallback.to(logits.dtype))[dead]
        else:
            logits[dead] = 0.0
    return logits


def filter_logits(scaled: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p nucleus / min-p floor to -inf (keeps >= 1)."""
    dev = scaled.device
    v = scaled.shape[1]
    ninf = float("-inf")
    if any(0 < k < v for k in top_k):
        ks = torch.tensor([k if 0 < k < v else v for k in top_k], device=dev)
        kmax = int(ks.max())
        top_vals = scaled.topk(kmax, dim=-1).values
        kth = top_vals.gather(1, (ks - 1).unsqueeze(1))
        scaled = scaled.masked_fill(scaled < kth, ninf)
    if any(p < 1.0 for p in top_p):
        ps = torch.tensor(top_p, dtype=scaled.dtype, device=dev).unsqueeze(1)
        sorted_vals, order = scaled.sort(dim=-1, descending=True)
        probs = sorted_vals.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop_sorted = before > ps
        drop_sorted[:, 0] = False
        drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, ninf)
    if any(m > 0.0 for m in min_p):
        ms = torch.tensor(min_p, dtype=scaled.dtype, device=dev).unsqueeze(1)
        probs = scaled.softmax(dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * ms
        scaled = scaled.masked_fill(probs < floor, ninf)
    return scaled


class Sampler:
    """Batched counter-based sampler for one vocabulary on one device."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.vocab_hash = token_hashes(vocab_size, device)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleOutput:
        """``logits`` is ``rows x vocab`` float32 (or float64); one token per row."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sample rows")
        if not rows:
            return SampleOutput([], None, None, None)
        dev = logits.device
        shaped = apply_constraint_masks(
            apply_allowed_tokens(apply_logit_bias(apply_penalties(logits, rows), rows), rows), rows)
        logits = sanitize(apply_min_tokens_mask(shaped, rows),
                          apply_constraint_masks(apply_allowed_tokens(logits, rows), rows))
        tokens = logits.argmax(dim=-1)
        rand = [i for i, r in enumerate(rows) if r.spec.temperature >= MIN_TEMPERATURE]
        if rand:
            sub = logits if len(rand) == len(rows) else logits[rand]
            temps = torch.tensor([float(rows[i].spec.temperature) for i in rand], dtype=sub.dtype, device=dev)
            scaled = sanitize(sub / temps.unsqueeze(1))
            scaled = filter_logits(
                scaled,
                [int(rows[i].spec.top_k) for i in rand],
                [float(rows[i].spec.top_p) for i in rand],
                [float(rows[i].spec.min_p) for i in rand],
            )
            keys = torch.tensor(
                [row_key(rows[i].seed, rows[i].output_index) for i in rand], dtype=torch.int64, device=dev
            )
            noise = gumbel_noise(keys, self.vocab_hash[: sub.shape[1]])
            picked = (scaled.double() + noise).argmax(dim=-1)
            if len(rand) == len(rows):
                tokens = picked
            else:
                tokens[torch.tensor(rand, device=dev)] = picked
        token_list = [int(t) for t in tokens.tolist()]
        want_lp = any(r.spec.logprobs or r.spec.top_logprobs > 0 for r in rows)
        if not want_lp:
            return SampleOutput(token_list, None, None, None)
        lp = torch.log_softmax(sanitize(logits.float()), dim=-1)  # float64 extremes overflow float32
        chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        kmax = max(int(r.spec.top_logprobs) for r in rows)
        top_ids: list[list[int]] = [[] for _ in rows]
        top_lps: list[list[float]] = [[] for _ in rows]
        if kmax > 0:
            vals, ids = lp.topk(min(kmax, lp.shape[1]), dim=-1)
            vl, il = vals.tolist(), ids.tolist()
            for i, r in enumerate(rows):
                k = int(r.spec.top_logprobs)
                top_ids[i] = [int(x) for x in il[i][:k]]
                top_lps[i] = [float(x) for x in vl[i][:k]]
        return SampleOutput(token_list, [float(x) for x in chosen], top_ids, top_lps)
