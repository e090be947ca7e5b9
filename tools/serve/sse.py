"""Server-sent events over raw ASGI, with the client's disconnect watched and what a slow client costs bounded.

``SSEResponse`` runs three tasks: the producer, which writes events into an ``EventSink``; the sink's sender, which
hands them to the connection; and a watch for the client's ``http.disconnect``, which cancels the other two (the
cleanup, shielded, then cancels the engine requests). ``watch_disconnect`` is the same watch for non-streaming
handlers.

Why a sender of its own: if the producer wrote to the connection itself, a client that stops reading would stop
the producer, and the engine would keep the stream's frames for it, coalesced but whole, logprobs and all: one
stream with ``n=128, logprobs=20`` held 1.7 KB per token that way, hundreds of MB for a client that never read.
The producer now drains the engine as fast as it produces, and what waits for the client is the encoded events in
the sink, counted in bytes: past ``max_pending_bytes`` a write raises ``SlowClient``, and the request is ended with
an error event that names the limit. So one stream holds at most the limit, whatever ``n`` and ``logprobs`` are.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"

DEFAULT_MAX_PENDING_BYTES = 16 * 1024 * 1024

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


class SlowClient(Exception):
    """The client has not read ``limit`` bytes of its stream's events: the server holds no more for it."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the client did not read its stream: more than {limit} bytes of events were waiting for it "
                         "(--max-stream-buffer-bytes); the request was ended")
        self.limit = limit


class EventSink:
    """Where a producer writes events: held, in order, until the sender has handed them to the connection."""

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]], max_pending_bytes: int) -> None:
        self._send = send
        self._headers = headers
        self.max_pending_bytes = max_pending_bytes
        self._pending: deque[bytes] = deque()
        self.pending_bytes = 0
        self.sent_bytes = 0
        self._closed = False
        self._lot = trio.lowlevel.ParkingLot()
        self.started = False

    def write_nowait(self, data: bytes, *, last: bool = False) -> None:
        """Queue ``data``; raises ``SlowClient`` if that would hold more than the limit (``last``: the closing
        events of a request ended for that, queued past the limit, which they exceed by a few hundred bytes)."""
        if not last and self.pending_bytes + len(data) > self.max_pending_bytes:
            raise SlowClient(self.max_pending_bytes)
        self._pending.append(data)
        self.pending_bytes += len(data)
        self._lot.unpark_all()

    async def write(self, data: bytes) -> None:
        self.write_nowait(data)
        await trio.lowlevel.checkpoint()

    def close_nowait(self) -> None:
        """No more events: the sender ends once it has sent what is queued."""
        self._closed = True
        self._lot.unpark_all()

    async def _start(self) -> None:
        if not self.started:
            self.started = True
            await self._send({"type": "http.response.start", "status": 200, "headers": self._headers})

    async def run_sender(self) -> None:
        """Send the queued events as they come, until ``close_nowait`` and the queue is empty; then end the body."""
        await self._start()
        while True:
            while self._pending:
                data = self._pending.popleft()
                self.pending_bytes -= len(data)
                await self._send({"type": "http.response.body", "body": data, "more_body": True})
                self.sent_bytes += len(data)
            if self._closed:
                break
            await self._lot.park()
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


Producer = Callable[[EventSink], Awaitable[None]]


class SSEResponse(Response):
    """``text/event-stream`` written by ``producer``; ``on_disconnect`` is called if the client leaves first.

    ``flush_timeout`` bounds the wait for a client to read the last events of a stream ended because it did not
    read (``SlowClient``): once it reads nothing for that long, the connection is dropped."""

    media_type = "text/event-stream"

    def __init__(self, producer: Producer, on_disconnect: Callable[[], None], cleanup: Callable[[], Awaitable[None]],
                 *, max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES, flush_timeout: float = 10.0) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self._producer = producer
        self._on_disconnect = on_disconnect
        self._cleanup = cleanup
        self._max_pending = max_pending_bytes
        self._flush_timeout = flush_timeout
        self.disconnected = False
        self.slow_client = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sink = EventSink(send, self.raw_headers, self._max_pending)
        try:
            async with trio.open_nursery() as nursery:

                produced = False

                def gone() -> None:
                    # After the last event was written, a client that hangs up (the SDKs close on [DONE], before the
                    # body's terminating chunk) has left nothing: only the sending stops.
                    if not produced:
                        self.disconnected = True
                        self._on_disconnect()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch_disconnect, receive, gone)
                sender_done = trio.Event()

                async def sender() -> None:
                    await sink.run_sender()
                    sender_done.set()

                nursery.start_soon(sender)
                try:
                    await self._producer(sink)
                    produced = True
                except SlowClient:
                    self.slow_client = True
                finally:
                    sink.close_nowait()
                while self.slow_client and not sender_done.is_set():
                    sent = sink.sent_bytes
                    with trio.move_on_after(self._flush_timeout):
                        await sender_done.wait()
                    if sink.sent_bytes == sent:  # nothing read for flush_timeout: drop the connection
                        break
                else:
                    await sender_done.wait()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._cleanup()
