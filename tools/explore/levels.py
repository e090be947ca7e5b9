"""The explorer's two levels by name, and ``replay_token``, which the printed regression tests call.

The actor level is imported only when asked for: it needs trio's private scheduling hook (``tools.explore.schedule``
raises ``ImportError`` without it), and the core level needs no trio at all.
"""

from __future__ import annotations

from typing import Any

from tickloom.tools.explore.checks import Violation
from tickloom.tools.explore.driver import Level, decode_token, replay

LEVELS = ("core", "actors")


def level_named(name: str) -> Level[Any]:
    """The level called ``name``. Raises ``ImportError`` for the actor level if trio lacks its hook."""
    if name == "core":
        from tickloom.tools.explore.core import CORE

        return CORE
    if name == "actors":
        from tickloom.tools.explore.actors import ACTORS

        return ACTORS
    raise ValueError(f"unknown level {name!r}; known: {', '.join(LEVELS)}")


def replay_token(text: str) -> Violation | None:
    """Re-run a token's shrunk run on the code as built now (its variant only if the caller enabled it): its
    violation, or None. Raises ``ValueError`` for anything that is not a token."""
    token = decode_token(text)
    return replay(level_named(token.level), token)[1].violation
