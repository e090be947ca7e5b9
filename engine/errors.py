"""The exceptions of the public API. A leaf, like ``engine.outputs``: it imports only the core's ``ConfigError``, so
any room may raise or catch these without reaching the API floor."""

from __future__ import annotations

from tickloom.engine.core.errors import ConfigError


class EngineError(RuntimeError):
    """The engine crashed: an actor or the log writer failed. Names the actor and the cause."""

    def __init__(self, actor: str, cause: BaseException | str) -> None:
        self.actor = actor
        self.cause = cause
        detail = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"the {actor} actor failed: {detail}")


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (with ``overload="reject"``) or the engine is draining."""


class RequestRejected(ValueError):
    """A request was refused at submit; the message names the field or the problem. No stream was opened."""


__all__ = ["ConfigError", "EngineError", "EngineOverloaded", "RequestRejected"]
