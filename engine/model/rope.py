"""Rotary position embedding frequencies: plain, linear, Llama-3 and LongRoPE (Phi-3) scaling.

A ``Rope`` is what one kind of layer rotates its queries and keys by; a model has one (most) or two (Gemma 3: global
layers with the configured base and scaling, sliding-window layers with a local base and none).

LongRoPE has two frequency sets, "short" for the pretraining context and "long" beyond it. Transformers picks one
set per forward call by the call's largest position, so its cached generation rotates a token at position ``p``
with the long set exactly when ``p >= original_max_position_embeddings``. tickloom applies that per position (a
paged batch mixes requests of every length), which matches transformers' token-by-token generation; a single
transformers forward over a sequence longer than the original context uses the long set for all of it instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SCALING_TYPES = ("linear", "llama3", "longrope")
"""Rope scaling types tickloom implements (``su`` is an old name of ``longrope``)."""


@dataclass(frozen=True, slots=True)
class Rope:
    """Inverse frequencies per rotated pair; positions from ``long_from`` on use ``long_inv_freq`` (LongRoPE);
    ``scale`` multiplies cos and sin (LongRoPE's attention factor)."""

    inv_freq: tuple[float, ...]
    long_inv_freq: tuple[float, ...] | None = None
    long_from: int = 0
    scale: float = 1.0


def scaling_kind(scaling: dict[str, Any] | None) -> str | None:
    """The scaling type of a ``rope_scaling`` dict, None for no scaling."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    return "longrope" if kind == "su" else str(kind)


def base_inv_freq(theta: float, dim: int) -> list[float]:
    return [1.0 / (theta ** (i / dim)) for i in range(0, dim, 2)]


def scaled_inv_freq(theta: float, dim: int, scaling: dict[str, Any] | None) -> list[float]:
    """Inverse frequencies with linear or Llama-3 scaling (LongRoPE: its short set; see ``make_rope``)."""
    base = base_inv_freq(theta, dim)
    kind = scaling_kind(scaling)
    if kind is None or scaling is None:
        return base
    if kind == "longrope":
        return [f / float(s) for f, s in zip(base, scaling["short_factor"], strict=True)]
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return [f / factor for f in base]
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: {list(SCALING_TYPES)}")
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    out: list[float] = []
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen > low_wavelen:  # long wavelengths: interpolated by the factor
            out.append(f / factor)
        elif wavelen < high_wavelen:  # short ones: kept
            out.append(f)
        else:  # in between: a smooth blend of the two
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def longrope_attention_factor(scaling: dict[str, Any], max_position_embeddings: int) -> float:
    """``attention_factor`` if given, else ``sqrt(1 + ln(factor) / ln(original context))`` with ``factor`` the
    given one or the context's growth (``max_position_embeddings / original``), 1 when it does not grow."""
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    f = float(factor) if factor is not None else max_position_embeddings / original
    return 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(original))


def make_rope(theta: float, dim: int, scaling: dict[str, Any] | None, max_position_embeddings: int) -> Rope:
    inv = tuple(scaled_inv_freq(theta, dim, scaling))
    if scaling_kind(scaling) != "longrope" or scaling is None:
        return Rope(inv)
    long = tuple(f / float(s) for f, s in zip(base_inv_freq(theta, dim), scaling["long_factor"], strict=True))
    return Rope(inv, long, int(scaling["original_max_position_embeddings"]),
                longrope_attention_factor(scaling, max_position_embeddings))


def rope_tables(rope: Rope, n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin), each ``n x head_dim``, for positions ``0..n-1``: the angles in float32 (as the reference
    implementation computes them), the sin's first half negated (``llama.apply_rope``)."""
    pos = torch.arange(n, dtype=torch.float32)
    freqs = torch.outer(pos, torch.tensor(rope.inv_freq, dtype=torch.float64).float())
    if rope.long_inv_freq is not None and n > rope.long_from:
        long = torch.outer(pos[rope.long_from :], torch.tensor(rope.long_inv_freq, dtype=torch.float64).float())
        freqs[rope.long_from :] = long
    cos, sin = freqs.cos(), freqs.sin()
    if rope.scale != 1.0:
        cos, sin = cos * rope.scale, sin * rope.scale
    return (torch.cat((cos, cos), -1).to(device=device, dtype=dtype),
            torch.cat((-sin, sin), -1).to(device=device, dtype=dtype))
