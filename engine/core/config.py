"""The core's configuration: every knob that changes a scheduling decision, validated once."""

from __future__ import annotations

import msgspec

from tickloom.engine.core.errors import ConfigError


class CoreConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Scheduling configuration. Logged in every log header, so a replay runs with exactly these values."""

    num_blocks: int
    block_size: int = 16
    max_batch_size: int = 64
    max_seq_len: int = 2048
    max_prefill_tokens: int = 512
    """Prompt tokens per step, across all prefill chunks."""
    max_batch_tokens: int = 4096
    """All tokens per step: prefill chunks plus one per decode row."""
    admit_watermark: int = 0
    """Admission reserves room for ``min(max_tokens, admit_watermark)`` output tokens beyond the prompt (never
    beyond ``max_seq_len``; a request admitted while nothing runs reserves its prompt only)."""
    pipeline_depth: int = 1
    spill_enabled: bool = False
    preempt_immunity_tokens: int = 64
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 32000
    think_start_token: int | None = None
    think_end_token: int | None = None
    prefix_caching: bool = True
    max_waiting: int = 4096
    """Waiting-queue bound; the engine applies backpressure at submit, the core rejects beyond it."""

    def __post_init__(self) -> None:
        _positive(self, "num_blocks", "block_size", "max_batch_size", "max_seq_len", "max_prefill_tokens",
                  "max_batch_tokens", "vocab_size", "max_waiting")
        _non_negative(self, "admit_watermark", "preempt_immunity_tokens")
        if self.pipeline_depth not in (1, 2):
            raise ConfigError(f"pipeline_depth={self.pipeline_depth} must be 1 or 2")
        if self.max_batch_tokens < self.max_batch_size:
            raise ConfigError(
                f"max_batch_tokens={self.max_batch_tokens} is below max_batch_size={self.max_batch_size}: "
                "a full batch of decode rows would never fit in one step"
            )
        needed = self.max_seq_len // self.block_size + 1
        if needed > self.num_blocks:
            raise ConfigError(
                f"num_blocks={self.num_blocks} cannot hold one max_seq_len={self.max_seq_len} sequence: "
                f"that takes {needed} blocks of block_size={self.block_size}"
            )
        for field in ("think_start_token", "think_end_token"):
            value = getattr(self, field)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"{field}={value} is outside vocab_size={self.vocab_size}")
        if (self.think_start_token is None) != (self.think_end_token is None):
            raise ConfigError(
                f"think_start_token={self.think_start_token} and think_end_token={self.think_end_token} "
                "must be set together"
            )
        for token in self.eos_token_ids:
            if not 0 <= token < self.vocab_size:
                raise ConfigError(f"eos_token_ids contains {token}, outside vocab_size={self.vocab_size}")

    def to_json(self) -> str:
        return msgspec.json.encode(self, order="deterministic").decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> CoreConfig:
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid core config: {exc}") from exc


def _positive(config: CoreConfig, *fields: str) -> None:
    for field in fields:
        value = getattr(config, field)
        if value <= 0:
            raise ConfigError(f"{field}={value} must be positive")


def _non_negative(config: CoreConfig, *fields: str) -> None:
    for field in fields:
        value = getattr(config, field)
        if value < 0:
            raise ConfigError(f"{field}={value} must not be negative")
