"""tickloom's public API: an event-sourced LLM engine for async apps.

Names load lazily, so ``import engine.core`` (replay, the explorer) pulls in neither trio nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Engine": "tickloom.engine.api",
    "RequestStream": "tickloom.engine.api",
    "EngineConfig": "tickloom.engine.config",
    "FaultPlan": "tickloom.engine.config",
    "SamplingParams": "tickloom.engine.params",
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
    "RequestOutput",
    "RequestRejected",
    "RequestStream",
    "RequestUsage",
    "SamplingParams",
]

if TYPE_CHECKING:
    from tickloom.engine.api import Engine, RequestStream
    from tickloom.engine.config import EngineConfig, FaultPlan
    from tickloom.engine.errors import ConfigError, EngineError, EngineOverloaded, RequestRejected
    from tickloom.engine.outputs import RequestOutput, RequestUsage
    from tickloom.engine.params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
