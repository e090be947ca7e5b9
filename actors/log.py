"""The log actor: group commit. The step actor appends whole frames to the writer's buffer; this actor decides
when the rest reach the OS and the disk.

Two guarantees, for two kinds of crash:

* **Process crash (``kill -9``, an abort, the OOM killer): acknowledged means logged, whatever the policy.** The
  step actor hands a tick's frame (and all before it) to the OS with ``write(2)`` before that tick's
  ``EmitTokens`` or ``Finish`` reach the retire actor, i.e. before any client can see them. Data handed to the
  OS survives the death of the process, so every token a client received is in the log, and ``recover_log``
  finds it after at most a torn final frame. Ticks with nothing client-visible are batched here.
* **Machine crash (power loss, kernel panic): the ``fsync`` policy.** ``"never"`` leaves it to the kernel's
  writeback, so recently acknowledged tokens may be lost; ``"<N>ms"`` fsyncs every N milliseconds, bounding the
  loss to about that window; ``"tick"`` is done by the step actor itself (flush and fsync before a tick's
  commands leave), so nothing acknowledged is lost, at the cost of one fsync per tick.

Between those flushes, ``"never"`` flushes to the page cache every ``FLUSH_INTERVAL`` seconds (and whenever the
buffer passes ``FLUSH_BYTES``), and ``"<N>ms"`` flushes and fsyncs every N milliseconds.
A write error is fatal (``LogWriteFailed``): the log cannot be trusted to be complete after it.
"""

from __future__ import annotations

import trio

from tickloom.events import LogWriter

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
        """Hand every buffered frame to the OS (``write(2)``, no fsync); an error is ``LogWriteFailed``."""
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
