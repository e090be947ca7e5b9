"""``EngineConfig``: the model, the device, the KV pool, spill, the log, and the core's scheduling knobs."""

from __future__ import annotations

from typing import Literal

import msgspec

from engine.core import ConfigError


class FaultPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Faults to inject, for tests and chaos runs. Each is logged like any other input, so the run replays."""

    fail_steps: list[int] = []
    """Step ids the device reports as failed."""
    fail_spill: list[str] = []
    """Request ids whose spill write fails."""
    fail_swap_in: list[str] = []
    """Request ids whose swap-in read fails."""
    crash_actor: str | None = None
    """An actor name ("deadlines", "retire", "spill", "swap-in", "log") that raises after ``crash_after`` s."""
    crash_after: float = 0.0
    report_delay: float = 0.0
    """Seconds the retire actor's reports (stop matches, clients gone) are held back: a late-noticed match."""


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How to build an engine. ``model="stub"`` runs the core's oracle instead of a model (tests, benchmarks)."""

    model: str = "smollm2-135m"
    dtype: str | None = None
    """None: float32 on CPU, bfloat16 on CUDA."""
    device: str = "cpu"
    threads: int | None = None
    num_blocks: int | None = None
    """KV blocks; None derives them from ``kv_memory_bytes``."""
    kv_memory_bytes: int = 256 << 20
    block_size: int = 16
    max_batch_size: int = 32
    max_seq_len: int = 2048
    max_prefill_tokens: int = 512
    max_batch_tokens: int = 2048
    admit_watermark: int = 0
    pipeline_depth: int = 2
    preempt_immunity_tokens: int = 64
    prefix_caching: bool = True
    max_waiting: int = 1024
    """Requests that may wait beyond a full batch: at most ``max_waiting + max_batch_size`` are open at once;
    past that, submit waits (``overload="wait"``) or raises ``EngineOverloaded`` (``"reject"``)."""
    overload: Literal["wait", "reject"] = "wait"
    spill_dir: str | None = None
    """A spill store's disk tier (a private subdirectory is made in it). Spill is on when this is set or
    ``host_spill_bytes`` > 0."""
    host_spill_bytes: int = 0
    log_path: str | None = None
    fsync: str = "never"
    """``"never"``, ``"tick"`` or ``"<N>ms"``."""
    snapshot_every: int = 0
    """Ticks between core snapshots in the log (0: none)."""
    think_start_token: int | None = None
    think_end_token: int | None = None
    stub_vocab_size: int = 96
    stub_step_time: float = 0.01
    """Seconds per step of the stub model (virtual time under ``MockClock``)."""
    faults: FaultPlan | None = None

    def __post_init__(self) -> None:
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_blocks={self.num_blocks} must be positive")
        if self.host_spill_bytes < 0:
            raise ConfigError(f"host_spill_bytes={self.host_spill_bytes} must not be negative")
        if self.overload not in ("wait", "reject"):
            raise ConfigError(f"overload={self.overload!r} must be 'wait' or 'reject'")
        from actors.log import parse_fsync

        try:
            parse_fsync(self.fsync)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def spill_enabled(self) -> bool:
        return self.spill_dir is not None or self.host_spill_bytes > 0
