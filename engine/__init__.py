"""tickloom's public API: an event-sourced LLM engine for async apps.

Names load lazily, so ``import engine.core`` (replay, the explorer) pulls in neither trio nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Engine": "engine.api",
    "RequestStream": "engine.api",
    "EngineConfig": "engine.config",
    "FaultPlan": "engine.config",
    "SamplingParams": "engine.params",
    "RequestOutput": "actors.outputs",
    "RequestUsage": "actors.outputs",
    "EngineError": "engine.errors",
    "EngineOverloaded": "engine.errors",
    "RequestRejected": "engine.errors",
    "ConfigError": "engine.errors",
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
    from actors.outputs import RequestOutput, RequestUsage
    from engine.api import Engine, RequestStream
    from engine.config import EngineConfig, FaultPlan
    from engine.errors import ConfigError, EngineError, EngineOverloaded, RequestRejected
    from engine.params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
