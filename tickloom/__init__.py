"""tickloom: an event-sourced LLM inference engine for async apps.

The public API::

    from tickloom import Engine, EngineConfig, SamplingParams

The rest is reached through subpackages: ``tickloom.events`` (the typed events and the log), ``tickloom.replay``
(replay, bisect, the explorer), ``tickloom.engine.core`` (the pure scheduler), ``tickloom.actors`` (the trio
actors) and ``tickloom.tools`` (the ``tickloom`` command).

Names load lazily, so ``import tickloom.engine.core`` (replay, the explorer) pulls in neither trio nor torch.

Why the subpackages live outside this folder: the repository keeps the design card's top-level folders
(``engine/``, ``events/``, ``actors/``, ``replay/``, ``tools/``), and the installed wheel nests them under
``tickloom/`` (setuptools follows the links below when it builds), so only the name ``tickloom`` is ever
installed. In a checkout this folder holds symbolic links to them, which Python, mypy, editors and setuptools all
follow. A checkout made without links (git on a file system without symlinks writes each link as a small text
file) has no ``engine/`` folder here; then the folder above, which holds the real ones, is searched instead.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if not (Path(__file__).parent / "engine").is_dir() and (Path(__file__).parent.parent / "engine" / "core").is_dir():
    __path__.append(str(Path(__file__).parent.parent))

from tickloom.engine import __all__ as _API  # the public API's one list of names (engine/__init__.py)

__all__ = list(_API)

if TYPE_CHECKING:
    from tickloom.engine import *  # noqa: F403  (the same names, for type checkers)


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'tickloom' has no attribute {name!r}")
    value = getattr(importlib.import_module("tickloom.engine"), name)
    globals()[name] = value
    return value
