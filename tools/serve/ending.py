"""How the server ends the requests it still has open when it must stop serving them.

Three things end a server with requests open: a drain that times out, a second SIGTERM, and the engine failing
(its log disk full, say). A request cut by hypercorn's own shutdown would leave its client with a broken connection
and no reason; so the server first ends each open request itself, through ``OpenRequests.end_all(reason)``: the
part of each handler that waits for the engine runs in a cancel scope registered here, ``end_all`` cancels them
all, and each handler then answers with ``reason`` (a stream: an error event and ``[DONE]``; a whole answer: a 503).
Only then is hypercorn stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio

from tickloom.tools.serve.openai_types import OpenAIError


class OpenRequest:
    """One request's handler, while it is open. ``waiting`` is the scope to wait for the engine in."""

    def __init__(self, owner: OpenRequests) -> None:
        self._owner = owner
        self.waiting = trio.CancelScope()

    @property
    def ended(self) -> OpenAIError | None:
        """Why the server ended this request (None: it was not ended by the server)."""
        if self.waiting.cancelled_caught and self._owner.reason is not None:
            return self._owner.error()
        return None


class OpenRequests:
    def __init__(self) -> None:
        self._open: set[OpenRequest] = set()
        self.reason: str | None = None
        """Set by ``end_all``: why every open request, and every later one, is ended."""
        self._lot = trio.lowlevel.ParkingLot()

    def __len__(self) -> int:
        return len(self._open)

    def error(self) -> OpenAIError:
        assert self.reason is not None
        return OpenAIError(503, self.reason, type="server_error", code="server_shutting_down")

    @contextmanager
    def track(self) -> Iterator[OpenRequest]:
        """Count a handler open for the block; its ``waiting`` scope is cancelled by ``end_all`` (at once, if that
        has happened already)."""
        request = OpenRequest(self)
        if self.reason is not None:
            request.waiting.cancel()
        self._open.add(request)
        try:
            yield request
        finally:
            self._open.discard(request)
            if not self._open:
                self._lot.unpark_all()

    def end_all(self, reason: str) -> None:
        """End every open request with ``reason`` (the first reason given stands)."""
        if self.reason is None:
            self.reason = reason
        for request in self._open:
            request.waiting.cancel()

    async def wait_closed(self) -> None:
        """Return once no handler is open."""
        while self._open:
            await self._lot.park()


__all__ = ["OpenRequest", "OpenRequests"]
