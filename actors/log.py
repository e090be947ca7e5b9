"""The log actor: group commit. The step actor appends whole frames to the writer's buffer; this actor decides
when they reach the OS and the disk.

``fsync`` policy: ``"never"`` flushes to the page cache every ``FLUSH_INTERVAL`` seconds (and whenever the
buffer passes ``FLUSH_BYTES``); ``"<N>ms"`` flushes and fsyncs every N milliseconds; ``"tick"`` is done by the
step actor itself (flush and fsync before a tick's commands leave), and this actor only keeps flushing.
A write error is fatal: the log cannot be trusted to be complete after it.
"""

from __future__ import annotations

import trio

from events import LogWriter

FLUSH_INTERVAL = 0.05
FLUSH_BYTES = 1 << 16


class LogWriteFailed(OSError):
    """Writing the log failed; the engine stops (every open stream gets ``EngineError``)."""


def parse_fsync(policy: str) -> float | None:
    """None for ``"never"``/``"tick"``, else the fsync interval in seconds for ``"<N>ms"``."""
    if policy in ("never", "tick"):
        return None
    if policy.endswith("ms") and policy[:-2].isdigit() and int(policy[:-2]) > 0:
        return int(policy[:-2]) / 1000
    raise ValueError(f"fsync={policy!r} must be 'never', 'tick' or '<N>ms' with N > 0")


class LogActor:
    def __init__(self, writer: LogWriter, fsync: str) -> None:
        self.writer = writer
        self._fsync_every = parse_fsync(fsync)

    def flush_if_large(self) -> None:
        """Called by the step actor after each append."""
        if self.writer.pending_bytes >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        try:
            self.writer.flush()
        except OSError as exc:
            raise LogWriteFailed(f"writing {self.writer.path} failed: {exc}") from exc

    async def sync(self) -> None:
        self.flush()
        try:
            await trio.to_thread.run_sync(self.writer.fsync)
        except OSError as exc:
            raise LogWriteFailed(f"fsync of {self.writer.path} failed: {exc}") from exc

    async def run(self) -> None:
        interval = self._fsync_every if self._fsync_every is not None else FLUSH_INTERVAL
        while True:
            await trio.sleep(interval)
            if self._fsync_every is not None:
                await self.sync()
            else:
                self.flush()
