"""The engine for asyncio apps, with the same API: ``from tickloom.asyncio import Engine``."""

from tickloom.engine.asyncio import Engine

__all__ = ["Engine"]
