"""Server-sent events over raw ASGI, with the client's disconnect watched.

``SSEResponse`` runs a producer (which writes events through an ``EventSink``) next to a task that waits for the
client's ``http.disconnect``; a disconnect cancels the producer, whose cleanup (``finally``, shielded) cancels
its engine requests. ``watch_disconnect`` is the same watch for non-streaming handlers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


def event(payload: Any) -> bytes:
    """One ``data:`` event holding ``payload`` as JSON (msgspec never emits raw newlines in JSON)."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


async def watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    """Wait for ``http.disconnect`` (skipping any body left unread), then call ``on_disconnect``."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


class EventSink:
    """What a producer writes events to; the first write sends the response's headers."""

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        self._send = send
        self._headers = headers
        self.started = False

    async def write(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            await self._send({"type": "http.response.start", "status": 200, "headers": self._headers})
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def close(self) -> None:
        if not self.started:
            await self.write(b"")
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


Producer = Callable[[EventSink], Awaitable[None]]


class SSEResponse(Response):
    """``text/event-stream`` written by ``producer``; ``on_disconnect`` is called if the client leaves first."""

    media_type = "text/event-stream"

    def __init__(self, producer: Producer, on_disconnect: Callable[[], None], cleanup: Callable[[], Awaitable[None]],
                 ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self._producer = producer
        self._on_disconnect = on_disconnect
        self._cleanup = cleanup
        self.disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sink = EventSink(send, self.raw_headers)
        try:
            async with trio.open_nursery() as nursery:

                def gone() -> None:
                    self.disconnected = True
                    self._on_disconnect()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch_disconnect, receive, gone)
                await self._producer(sink)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._cleanup()
        if not self.disconnected:
            await sink.close()
