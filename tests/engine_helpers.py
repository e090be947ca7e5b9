"""Shared pieces of the engine scenario tests (E01–E08)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tickloom import EngineConfig, RequestOutput
from tickloom.events import Finish, LogReader
from tickloom.replay import verify


def stub_config(log: Path, **kw: Any) -> EngineConfig:
    """The stub model (oracle tokens, printable-ASCII tokenizer), logging to ``log``."""
    base: dict[str, Any] = dict(model="stub", log_path=str(log), num_blocks=128, max_seq_len=256,
                                stub_step_time=0.01, max_batch_size=16, pipeline_depth=2)
    base.update(kw)
    return EngineConfig(**base)


def assert_replays(log: Path) -> None:
    """E07: every engine run's log replays exactly."""
    report = verify(log)
    assert report.status == "identical", report.format_text()


def core_finishes(log: Path) -> dict[str, Finish]:
    """The core's own ``Finish`` commands, from the log."""
    with LogReader(log) as reader:
        return {c.request_id: c for t in reader.ticks() for c in t.outputs.commands if isinstance(c, Finish)}


def joined(frames: list[RequestOutput]) -> tuple[list[int], str, RequestOutput]:
    tokens = [t for f in frames for t in f.token_ids]
    return tokens, "".join(f.text_delta for f in frames), frames[-1]
