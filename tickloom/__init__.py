"""tickloom: an event-sourced LLM inference engine for async apps.

The public API, and its one export table::

    from tickloom import Engine, EngineConfig, SamplingParams

The modules of this folder are the API floor: ``api`` (``Engine``), ``asyncio`` (the same API for asyncio apps),
``runtime`` (the actors wired together), ``config``, ``params`` (the validation boundary) and ``prompts``. Below it
lie the subpackages: ``tickloom.actors`` (the trio actors), ``tickloom.replay`` (replay, bisect, what-if),
``tickloom.engine`` (the pure scheduler core and the model) and ``tickloom.events`` (the typed events and the log).
Above it: ``tickloom.fleet`` and ``tickloom.tools`` (the ``tickloom`` command). ARCHITECTURE.md draws the floors.

Names load lazily, so ``import tickloom.engine.core`` (replay, the explorer) pulls in neither trio nor torch.

Why the subpackages are links: the repository keeps the design card's top-level folders (``engine/``, ``events/``,
``actors/``, ``replay/``, ``tools/``, ``fleet/``), and this folder holds a symbolic link to each. Python, mypy,
editors and setuptools follow them, and the installed wheel nests the folders under ``tickloom/``, so only the name
``tickloom`` is ever installed. A checkout without links (git with ``core.symlinks=false`` writes each link as a
small text file) cannot import them, and is told so at import, with the fix. It is never patched up by adding
the repository root to this package's path: that would make ``tests/``, ``scripts/`` and everything else at the
root ``tickloom`` subpackages.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if (Path(__file__).parent / "engine").is_file():
    raise ImportError(
        f"{Path(__file__).parent}: this checkout holds its symbolic links as plain files (git's core.symlinks is "
        "false here); tickloom's subpackages are links to the top-level folders. Fix the checkout: "
        "git config core.symlinks true && git checkout -- tickloom")

_EXPORTS = {
    "Engine": "tickloom.api",
    "RequestStream": "tickloom.api",
    "Request": "tickloom.request",
    "EngineConfig": "tickloom.config",
    "FaultPlan": "tickloom.config",
    "SamplingParams": "tickloom.params",
    "StructuredOutputs": "tickloom.params",
    "RequestOutput": "tickloom.engine.outputs",
    "RequestUsage": "tickloom.engine.outputs",
    "EngineError": "tickloom.engine.errors",
    "EngineOverloaded": "tickloom.engine.errors",
    "RequestRejected": "tickloom.engine.errors",
    "ConfigError": "tickloom.engine.errors",
}

__all__ = [
    "ConfigError",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineOverloaded",
    "FaultPlan",
    "Request",
    "RequestOutput",
    "RequestRejected",
    "RequestStream",
    "RequestUsage",
    "SamplingParams",
    "StructuredOutputs",
]

if TYPE_CHECKING:
    from tickloom.api import Engine, RequestStream
    from tickloom.config import EngineConfig, FaultPlan
    from tickloom.engine.errors import ConfigError, EngineError, EngineOverloaded, RequestRejected
    from tickloom.engine.outputs import RequestOutput, RequestUsage
    from tickloom.params import SamplingParams, StructuredOutputs
    from tickloom.request import Request


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tickloom' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
