"""The scheduling knobs, declared once, and the core's configuration built from them.

``SchedulingKnobs`` is the one declaration of every knob that changes a scheduling decision: its default, its
bound (a msgspec ``Meta``) and its one-line meaning (the ``Meta`` description). ``CoreConfig`` inherits the knobs
and adds what the engine derives (the pool size, the model's vocabulary and EOS ids, whether spill is on);
``tickloom.config.EngineConfig`` inherits the same knobs, so neither copies a default or a bound. The README's
configuration table is generated from these declarations (``tests/test_engine_config_table.py`` checks it).

The bounds are checked when a configuration is made (``msgspec.convert`` against the declared types), so
``CoreConfig(...)``, ``CoreConfig.from_json`` and ``EngineConfig(...)`` refuse the same values with the same
message, which names the field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from tickloom.engine.core.errors import ConfigError

T = TypeVar("T")

TOKEN_ID_MAX = 2**31 - 1
"""The largest token id anything accepts (an int32, as the model's tensors hold them)."""

BlockCount = Annotated[int, Meta(ge=1, le=2**24)]
TokenIdKnob = Annotated[int, Meta(ge=0, le=TOKEN_ID_MAX)]


class SchedulingKnobs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every knob that changes a scheduling decision: the one declaration (see the module docstring)."""

    block_size: Annotated[int, Meta(ge=1, le=4096, description="Tokens per KV block.")] = 16
    max_batch_size: Annotated[int, Meta(ge=1, le=65536, description="Sequences in one step, at most.")] = 32
    max_seq_len: Annotated[int, Meta(
        ge=2, le=2**24, description="Prompt plus output tokens of one sequence, at most (the engine also caps it at "
                                    "the model's context).")] = 2048
    max_prefill_tokens: Annotated[int, Meta(
        ge=1, le=2**24, description="Prompt tokens per step, across all prefill chunks.")] = 512
    max_batch_tokens: Annotated[int, Meta(
        ge=1, le=2**24, description="All tokens per step: prefill chunks plus one per decode row; at least "
                                    "max_batch_size.")] = 2048
    admit_watermark: Annotated[int, Meta(
        ge=0, le=2**24, description="Admission reserves room for min(max_tokens, this) output tokens beyond the "
                                    "prompt (never beyond max_seq_len; a request admitted while nothing runs "
                                    "reserves its prompt only).")] = 0
    pipeline_depth: Annotated[Literal[1, 2], Meta(
        description="Steps in flight: 2 plans step t+1 while step t runs (running ahead).")] = 2
    preempt_immunity_tokens: Annotated[int, Meta(
        ge=0, le=2**31, description="A sequence (re)scheduled is not preempted again before it has produced this "
                                    "many more output tokens.")] = 64
    prefix_caching: Annotated[bool, Meta(
        description="Reuse the KV blocks of identical prompt prefixes across requests.")] = True
    max_waiting: Annotated[int, Meta(
        ge=1, le=2**24, description="Requests waiting at once, at most: the core refuses an arrival beyond it, so "
                                    "the engine keeps at most this many requests open (submit then waits, or raises "
                                    "EngineOverloaded with overload='reject').")] = 1024
    speculative_tokens: Annotated[int, Meta(
        ge=0, le=32, description="Speculative decoding: proposal slots a decode row may carry, verified in the same "
                                 "step (0: off). The executor's proposer fills them; a row that keeps rejecting "
                                 "proposes fewer.")] = 0
    speculative_max_running: Annotated[int, Meta(
        ge=1, le=65536, description="Decode rows get proposal slots only while at most this many sequences run: a "
                                    "larger batch already keeps the device busy, and verifying proposals then costs "
                                    "more than it saves (vLLM's disable_by_batch_size). On a CPU a step of more "
                                    "than a few rows is bound by arithmetic, so the default is small.")] = 2
    think_start_token: Annotated[TokenIdKnob | None, Meta(
        description="The token that opens a reasoning span (set with think_end_token); thinking_budget counts the "
                    "tokens inside.")] = None
    think_end_token: Annotated[TokenIdKnob | None, Meta(
        description="The token that closes a reasoning span.")] = None

    def check_knob_relations(self, what: str) -> None:
        """The checks that relate two knobs (a single knob's bound is its ``Meta``)."""
        if self.max_batch_tokens < self.max_batch_size:
            raise ConfigError(f"{what}.max_batch_tokens={self.max_batch_tokens} is below max_batch_size="
                              f"{self.max_batch_size}: a full batch of decode rows would never fit in one step")
        if (self.think_start_token is None) != (self.think_end_token is None):
            raise ConfigError(f"{what}.think_start_token={self.think_start_token} and think_end_token="
                              f"{self.think_end_token} must be set together")


class _CoreFields(SchedulingKnobs, frozen=True, kw_only=True, forbid_unknown_fields=True):
    num_blocks: Annotated[BlockCount, Meta(description="KV blocks in the pool.")]
    spill_enabled: Annotated[bool, Meta(description="A spill store exists: preemption may swap out.")] = False
    eos_token_ids: tuple[TokenIdKnob, ...] = ()
    vocab_size: Annotated[int, Meta(ge=1, le=2**24)] = 32000


class CoreConfig(_CoreFields, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Scheduling configuration. Logged in every log header, so a replay runs with exactly these values."""

    def __post_init__(self) -> None:
        converted(msgspec.structs.asdict(self), _CoreFields, "CoreConfig", ConfigError)
        self.check_knob_relations("CoreConfig")
        needed = self.max_seq_len // self.block_size + 1
        if needed > self.num_blocks:
            raise ConfigError(
                f"CoreConfig.num_blocks={self.num_blocks} cannot hold one max_seq_len={self.max_seq_len} sequence: "
                f"that takes {needed} blocks of block_size={self.block_size}"
            )
        for field in ("think_start_token", "think_end_token"):
            value = getattr(self, field)
            if value is not None and value >= self.vocab_size:
                raise ConfigError(f"CoreConfig.{field}={value} is outside vocab_size={self.vocab_size}")
        for token in self.eos_token_ids:
            if token >= self.vocab_size:
                raise ConfigError(f"CoreConfig.eos_token_ids contains {token}, outside vocab_size={self.vocab_size}")

    def to_json(self) -> str:
        return msgspec.json.encode(self, order="deterministic").decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> CoreConfig:
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid core config: {exc}") from exc


def converted(value: Any, type_: type[T] | Any, what: str, error: type[ValueError]) -> T:
    """``msgspec.convert(value, type_)`` (strict: no bool for int, no str for numbers), a failure raised as ``error``.

    The message starts with ``what`` (the parameter or struct) and, when the failing field is a key of ``value``,
    its name and value, then msgspec's own text with its path, e.g.
    ``CoreConfig.block_size=0: Expected `int` >= 1 - at `$.block_size```.
    """
    try:
        result: T = msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        found = _PATH.search(str(exc))
        if found is not None and isinstance(value, dict) and found.group(1) in value:
            name = found.group(1)
            raise error(f"{what}.{name}={_short(value[name])}: {exc}") from None
        raise error(f"{what}: {exc}") from None
    return result


_PATH = re.compile(r"(?:at|in) `\$\.([A-Za-z_][A-Za-z0-9_]*)")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
