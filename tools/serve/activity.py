"""What the server says while it runs: one access-log line per HTTP request, and a stats line every few seconds.

Both go to the server's output (stderr under ``tickloom serve``) and each can be switched off
(``--no-access-log``, ``--stats-interval 0``). An access line is written when the response ends, as::

    127.0.0.1 "POST /v1/chat/completions HTTP/1.1" 200 1534 B 812.4 ms

A path is the client's choice, so it is written with every character outside printable ASCII escaped and cut
at ``MAX_LOGGED_PATH`` characters: a request cannot forge a second line or flood the output. A stats line::

    tickloom serve: 41.2 tokens/s, 3 running, 0 waiting, KV cache 12.5% used

The throughput is over the interval (tokens the engine generated, from ``engine.stats()``), not since start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

import trio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_LOGGED_PATH = 200
"""Characters of a request's path (and query) an access line keeps."""


def printable(text: str, limit: int = MAX_LOGGED_PATH) -> str:
    """``text`` with every character outside printable ASCII as an escape (``\\n``, ``\\x1b``, ``\\u2028``), cut at
    ``limit`` characters (then ``...``)."""
    cut = text[:limit]
    escaped = "".join(c if " " <= c <= "~" and c != "\\" else c.encode("unicode_escape").decode("ascii")
                      if c != "\\" else "\\\\" for c in cut)
    return escaped + ("..." if len(text) > limit else "")


class AccessLog:
    """ASGI middleware: one line per HTTP request to ``out`` when its response has ended (or the request failed,
    with status ``-`` if no response started)."""

    def __init__(self, app: ASGIApp, out: TextIO) -> None:
        self.app = app
        self.out = out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: int | None = None
        sent = 0

        async def counting(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting)
        finally:
            client = scope.get("client")
            query = scope.get("query_string", b"").decode("latin-1")
            target = scope.get("path", "") + (f"?{query}" if query else "")
            elapsed_ms = (time.perf_counter() - started) * 1000
            print(f'{client[0] if client else "-"} "{scope.get("method", "-")} {printable(target)} '
                  f'HTTP/{scope.get("http_version", "1.1")}" {status if status is not None else "-"} {sent} B '
                  f"{elapsed_ms:.1f} ms", file=self.out, flush=True)


def stats_line(now: dict[str, Any], before: dict[str, Any] | None, seconds: float) -> str:
    """One stats line from two ``engine.stats()`` readings ``seconds`` apart (``before`` None: the first)."""
    tokens = now.get("tokens", 0) - (before.get("tokens", 0) if before is not None else now.get("tokens", 0))
    rate = tokens / seconds if seconds > 0 else 0.0
    line = f"tickloom serve: {rate:.1f} tokens/s, {now.get('running', 0)} running, {now.get('waiting', 0)} waiting"
    total = now.get("blocks_total")
    if total:
        held = total - now.get("blocks_free", 0) - now.get("blocks_cached", 0)
        line += f", KV cache {100 * held / total:.1f}% used"
    return line


async def report_stats(stats: Callable[[], dict[str, Any]], interval: float, out: TextIO) -> None:
    """Every ``interval`` seconds (trio's clock), a ``stats_line`` to ``out``, until cancelled."""
    before = stats()
    last = trio.current_time()
    while True:
        await trio.sleep(interval)
        now, at = stats(), trio.current_time()
        print(stats_line(now, before, at - last), file=out, flush=True)
        before, last = now, at
