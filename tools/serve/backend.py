"""What the server needs of what it serves, as Protocols: ``Engine`` has it, and so does
``fleet_backend.FleetBackend`` (N replicas on Ray behind the logged router). ``app`` and ``server`` are typed
against these alone: the configuration, the tokenizer, the context the engine runs with, a ``Request``'s stream
(``generate_request``; its ``aclose`` cancels it), stats, drain and failure; never an engine's runtime.

Also the two errors a backend other than the engine raises for one request: both are ``EngineError``s, so the
server's paths for an engine's failure carry them to the client (``translate.engine_error``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

from tickloom import EngineConfig, EngineError, RequestOutput
from tickloom.request import Request


class Decoder(Protocol):
    """The model's tokenizer, as the server uses it (``tickloom.prompts`` tokenizes with it as the engine does)."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class ServedStream(Protocol):
    """One request's frames (all ``n`` choices): ``start`` submits, iteration yields, ``aclose`` cancels."""

    async def start(self) -> None: ...

    def __aiter__(self) -> ServedStream: ...

    async def __anext__(self) -> RequestOutput: ...

    async def aclose(self) -> None: ...


class ServedEngine(Protocol):
    @property
    def config(self) -> EngineConfig: ...

    @property
    def tokenizer(self) -> Decoder: ...

    @property
    def max_seq_len(self) -> int:
        """The context the engine runs with (prompt + output tokens of one sequence): ``config.max_seq_len`` capped at
        the model's context, so the server's limits are the engine's, not the config's."""
        ...

    @property
    def failure(self) -> EngineError | None:
        """Set once the whole backend has failed (the server then stops serving, naming it)."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def generate_request(self, request: Request) -> ServedStream:
        """The request's stream, not yet started; a bad request raises ``RequestRejected`` here."""
        ...

    async def drain(self, timeout: float = math.inf) -> bool: ...


class BackendRequestError(EngineError):
    """One request failed in the backend around the engines (e.g. a fleet replica's stream broke): a 500."""

    def __init__(self, message: str, where: str = "fleet") -> None:
        super().__init__(where, message)
        self.args = (message,)


class ReplicaUnavailable(BackendRequestError):
    """The replica serving the request died, or no replica is live: a 503 (the message names the replica)."""


__all__ = ["BackendRequestError", "Decoder", "ReplicaUnavailable", "ServedEngine", "ServedStream"]
