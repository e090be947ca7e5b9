"""The server's edge: what one client may cost it before a handler sees its request.

* ``read_body`` reads a request body incrementally, refusing it with 413 as soon as it is larger than the limit
  (at once when ``Content-Length`` says so, before a byte of it is read) and with 408 when it has not arrived
  within the body timeout. ``request.body()`` would hold a body of any size, and wait for a slow one forever.
* ``require_api_key`` answers 401 to a request without one of the server's keys, on every route but ``/health``
  (and ``/metrics`` when it is left open). Keys are compared as SHA-256 digests with ``hmac.compare_digest``,
  against every key, so the time taken says nothing about how much of a key was right, nor which key.
* ``route_label`` names a request by its route template, so that ``/metrics`` holds one series per route and one
  for every path that matched none, whatever paths clients invent.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import trio
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from tickloom.tools.serve.openai_types import OpenAIError

API_KEY_ENV = "TICKLOOM_API_KEY"
"""Environment variable with the server's API keys, comma-separated (added to ``--api-key``)."""

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0

UNMATCHED = "unmatched"
"""The ``endpoint`` label of every request whose path is no route of the server's."""


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Bytes a request body may have (``--max-body-bytes``)."""
    timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    """Seconds the whole body may take to arrive (``--body-timeout``)."""

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {self.max_bytes}")
        if not self.timeout_s > 0:
            raise ValueError(f"body_timeout must be a positive number of seconds, got {self.timeout_s}")


class BodyAbandoned(Exception):
    """The client disconnected while its body was still arriving: there is nobody to answer."""


def _too_large(limits: BodyLimits) -> OpenAIError:
    return OpenAIError(413, f"the request body is larger than this server's limit of {limits.max_bytes} bytes "
                            "(--max-body-bytes)", code="request_too_large")


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    """The request's body, at most ``limits.max_bytes`` of it held at any time. Raises ``OpenAIError`` 413 (too
    large), 408 (too slow) or 400 (a malformed ``Content-Length``), and ``BodyAbandoned``."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise OpenAIError(400, f"Content-Length {declared[:40]!r} is not a number") from None
        if size > limits.max_bytes:
            raise _too_large(limits)
    chunks: list[bytes] = []
    received = 0
    with trio.move_on_after(limits.timeout_s) as scope:
        try:
            async for chunk in request.stream():
                received += len(chunk)
                if received > limits.max_bytes:
                    raise _too_large(limits)
                chunks.append(chunk)
        except ClientDisconnect:
            raise BodyAbandoned() from None
    if scope.cancelled_caught:
        raise OpenAIError(408, f"the request body did not arrive within {limits.timeout_s:g} s (--body-timeout); "
                               f"{received} bytes came", code="request_timeout")
    return b"".join(chunks)


def api_keys(given: Iterable[str], environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The keys from ``--api-key`` and ``$TICKLOOM_API_KEY`` (comma-separated), without blanks or repeats."""
    env = os.environ if environ is None else environ
    keys = [*given, *env.get(API_KEY_ENV, "").split(",")]
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_matches(presented: str, digests: Sequence[bytes]) -> bool:
    """Whether ``presented`` is one of the keys (given as digests), in time that does not depend on which."""
    mine = _digest(presented)
    found = False
    for digest in digests:
        found |= hmac.compare_digest(mine, digest)
    return found


def require_api_key(app: ASGIApp, keys: Sequence[str], *, open_paths: Iterable[str] = ("/health",)) -> ASGIApp:
    """Answer 401 (OpenAI error JSON) to an HTTP request to any path but ``open_paths`` whose
    ``Authorization: Bearer <key>`` is not one of ``keys``; with no keys, ``app`` itself."""
    if not keys:
        return app
    digests = [_digest(k) for k in keys]
    exempt = frozenset(open_paths)

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in exempt:
            await app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and key_matches(token.strip(), digests):
            await app(scope, receive, send)
            return
        reason = "no API key was given" if not header else "the API key is not valid"
        error = OpenAIError(401, f"{reason}: send `Authorization: Bearer <key>` with one of this server's keys",
                            code="invalid_api_key")
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": error.body()})

    return guarded


def route_label(path: str, routes: frozenset[str]) -> str:
    """The ``endpoint`` label of a request for ``path``: its route, or ``UNMATCHED``."""
    return path if path in routes else UNMATCHED


__all__ = [
    "API_KEY_ENV",
    "UNMATCHED",
    "BodyAbandoned",
    "BodyLimits",
    "api_keys",
    "key_matches",
    "read_body",
    "require_api_key",
    "route_label",
]
