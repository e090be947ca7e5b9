"""``EngineConfig``: the model, the device, the KV pool, spill, the log, and the core's scheduling knobs."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from tickloom.engine.core import ConfigError
from tickloom.engine.params import FLOAT_MAX, INT64_MAX, TokenId, checked

Positive = Annotated[int, Meta(ge=1, le=2**24)]
"""Sizes and counts: at least 1, and small enough that the lists and tensors they size stay allocatable."""
Bytes = Annotated[int, Meta(ge=0, le=2**48)]
Seconds = Annotated[float, Meta(ge=0.0, le=FLOAT_MAX)]
PathStr = Annotated[str, Meta(min_length=1, max_length=4096)]
Actor = Literal["step", "device", "deadlines", "retire", "spill", "swap-in", "log"]


class _FaultFields(msgspec.Struct, frozen=True, kw_only=True):
    fail_steps: list[Annotated[int, Meta(ge=0, le=INT64_MAX)]] = []
    """Step ids the device reports as failed."""
    fail_spill: list[str] = []
    """Request ids whose spill write fails."""
    fail_swap_in: list[str] = []
    """Request ids whose swap-in read fails."""
    crash_actor: Actor | None = None
    """An actor name ("deadlines", "retire", "spill", "swap-in", "log") that raises after ``crash_after`` s."""
    crash_after: Seconds = 0.0
    report_delay: Seconds = 0.0
    """Seconds the retire actor's reports (stop matches, clients gone) are held back: a late-noticed match."""


class FaultPlan(_FaultFields, frozen=True, kw_only=True):
    """Faults to inject, for tests and chaos runs. Each is logged like any other input, so the run replays.

    Invalid values raise ``ConfigError`` naming the field.
    """

    def __post_init__(self) -> None:
        _normalise(self, checked(msgspec.structs.asdict(self), _FaultFields, "FaultPlan", ConfigError))


class _EngineFields(msgspec.Struct, frozen=True, kw_only=True):
    model: PathStr = "smollm2-135m"
    dtype: Literal["float32", "float64", "float16", "bfloat16"] | None = None
    """None: float32 on CPU, bfloat16 on CUDA; for the bundled model on a CPU with native bfloat16 (with ``quant``
    also None), bfloat16 with int4 weights (``engine.model.loaders.default_setting``)."""
    quant: Literal["none", "int8", "int4"] | None = None
    """Weight-only quantization (CPU): int8 per output channel, or int4 in groups of 32 (GGUF Q4_0/Q4_1 blocks
    packed as they are; the LM head stays int8). None: the model's default (see ``dtype``)."""
    device: Annotated[str, Meta(min_length=1, max_length=64)] = "cpu"
    threads: Annotated[int, Meta(ge=1, le=4096)] | None = None
    num_blocks: Positive | None = None
    """KV blocks; None derives them from ``kv_memory_bytes``."""
    kv_memory_bytes: Annotated[int, Meta(ge=1, le=2**48)] = 256 << 20
    block_size: Annotated[int, Meta(ge=1, le=4096)] = 16
    max_batch_size: Annotated[int, Meta(ge=1, le=65536)] = 32
    max_seq_len: Annotated[int, Meta(ge=2, le=2**24)] = 2048
    max_prefill_tokens: Positive = 512
    max_batch_tokens: Positive = 2048
    admit_watermark: Annotated[int, Meta(ge=0, le=2**24)] = 0
    pipeline_depth: Literal[1, 2] = 2
    preempt_immunity_tokens: Annotated[int, Meta(ge=0, le=2**31)] = 64
    prefix_caching: bool = True
    max_waiting: Annotated[int, Meta(ge=0, le=2**20)] = 1024
    """Requests that may wait beyond a full batch: at most ``max_waiting + max_batch_size`` are open at once;
    past that, submit waits (``overload="wait"``) or raises ``EngineOverloaded`` (``"reject"``)."""
    overload: Literal["wait", "reject"] = "wait"
    spill_dir: PathStr | None = None
    """A spill store's disk tier (a private subdirectory is made in it). Spill is on when this is set or
    ``host_spill_bytes`` > 0."""
    host_spill_bytes: Bytes = 0
    log_path: PathStr | None = None
    fsync: Annotated[str, Meta(pattern="^(never|tick|[1-9][0-9]{0,8}ms)$")] = "never"
    """``"never"``, ``"tick"`` or ``"<N>ms"``."""
    snapshot_every: Annotated[int, Meta(ge=0, le=2**31)] = 0
    """Ticks between core snapshots in the log (0: none)."""
    think_start_token: TokenId | None = None
    think_end_token: TokenId | None = None
    stub_vocab_size: Annotated[int, Meta(ge=96, le=2**20)] = 96
    stub_step_time: Annotated[float, Meta(ge=0.0, le=3600.0)] = 0.01
    """Seconds per step of the stub model (virtual time under ``MockClock``)."""
    faults: FaultPlan | None = None


class EngineConfig(_EngineFields, frozen=True, kw_only=True):
    """How to build an engine. ``model="stub"`` runs the core's oracle instead of a model (tests, benchmarks).

    Every field is checked for type and range when the config is made (``msgspec.convert`` against the bounds
    declared on the fields); a bad one raises ``ConfigError`` naming it, e.g.
    ``EngineConfig: Expected `int` >= 1 - at `$.block_size```.
    """

    def __post_init__(self) -> None:
        fields: _EngineFields = checked(msgspec.structs.asdict(self), _EngineFields, "EngineConfig", ConfigError)
        if (fields.think_start_token is None) != (fields.think_end_token is None):
            raise ConfigError(f"EngineConfig.think_start_token={fields.think_start_token} and "
                              f"think_end_token={fields.think_end_token} must be set together")
        from tickloom.actors.log import parse_fsync

        try:
            parse_fsync(fields.fsync)
        except ValueError as exc:
            raise ConfigError(f"EngineConfig.{exc}") from None
        _normalise(self, fields)

    @property
    def spill_enabled(self) -> bool:
        return self.spill_dir is not None or self.host_spill_bytes > 0


def _normalise(target: msgspec.Struct, fields: msgspec.Struct) -> None:
    """Store the converted values (plain ints and floats, the config's own list copies) in the frozen struct."""
    for field in msgspec.structs.fields(fields):
        value = getattr(fields, field.name)
        if getattr(target, field.name) is not value:
            msgspec.structs.force_setattr(target, field.name, value)
