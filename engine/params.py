"""``SamplingParams``: how a request samples and stops, validated when it is made."""

from __future__ import annotations

import msgspec

from engine.errors import RequestRejected
from events import SamplingSpec


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling and stopping, as in vLLM. ``temperature=0`` is greedy. Invalid values raise ``RequestRejected``."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    """None: the core assigns one (stable, logged), so even unseeded runs replay."""
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str: bool = False
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    thinking_budget: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be between 0 and max_tokens"),
            ("temperature", self.temperature >= 0, "must not be negative"),
            ("top_k", self.top_k >= 0, "must not be negative (0 disables it)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be positive"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("top_logprobs", 0 <= self.top_logprobs <= 20, "must be in [0, 20]"),
            ("thinking_budget", self.thinking_budget is None or self.thinking_budget >= 0, "must not be negative"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must not be negative"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "must be in [0, 2**63)"),
        ]
        for field, ok, why in checks:
            if not ok:
                raise RequestRejected(f"SamplingParams.{field}={getattr(self, field)!r} {why}")

    def to_spec(self) -> SamplingSpec:
        """The logged wire form (the seed travels separately, in the arrival).

        Floats are made floats: ``temperature=0`` would otherwise encode as an int, decode as 0.0 and re-encode
        to other bytes, so a replay's digest would differ from the live run's.
        """
        return SamplingSpec(
            max_tokens=self.max_tokens, min_tokens=self.min_tokens, temperature=float(self.temperature),
            top_k=self.top_k, top_p=float(self.top_p), min_p=float(self.min_p),
            repetition_penalty=float(self.repetition_penalty), presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty), stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids), include_stop_str=self.include_stop_str,
            ignore_eos=self.ignore_eos, logprobs=self.logprobs, top_logprobs=self.top_logprobs,
            thinking_budget=self.thinking_budget, skip_special_tokens=self.skip_special_tokens,
        )
