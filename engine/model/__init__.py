"""The device side: weights, paged KV cache, paged-attention forward, counter-based sampling,
block copies, loaders and the executors.

Names are exported lazily, so ``import engine.model.stub`` (or ``engine.model.types``) never imports
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "ModelLoadError": "tickloom.engine.model.errors",
    "ModelConfig": "tickloom.engine.model.config",
    "StepResult": "tickloom.engine.model.types",
    "HostKV": "tickloom.engine.model.types",
    "ModelExecutor": "tickloom.engine.model.executor",
    "StubExecutor": "tickloom.engine.model.stub",
    "token_for": "tickloom.engine.model.stub",
    "LoadedModel": "tickloom.engine.model.loaders",
    "load_model": "tickloom.engine.model.loaders",
    "resolve_model": "tickloom.engine.model.registry",
    "available_models": "tickloom.engine.model.registry",
    "cache_dir": "tickloom.engine.model.registry",
    "TokenizerWrapper": "tickloom.engine.model.tokenizer",
    "write_tiny_model": "tickloom.engine.model.tiny",
    "LlamaModel": "tickloom.engine.model.llama",
    "PagedKVCache": "tickloom.engine.model.kv_cache",
}

__all__ = [
    "HostKV",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "ModelExecutor",
    "ModelLoadError",
    "PagedKVCache",
    "StepResult",
    "StubExecutor",
    "TokenizerWrapper",
    "available_models",
    "cache_dir",
    "load_model",
    "resolve_model",
    "token_for",
    "write_tiny_model",
]

if TYPE_CHECKING:
    from tickloom.engine.model.config import ModelConfig
    from tickloom.engine.model.errors import ModelLoadError
    from tickloom.engine.model.executor import ModelExecutor
    from tickloom.engine.model.kv_cache import PagedKVCache
    from tickloom.engine.model.llama import LlamaModel
    from tickloom.engine.model.loaders import LoadedModel, load_model
    from tickloom.engine.model.registry import available_models, cache_dir, resolve_model
    from tickloom.engine.model.stub import StubExecutor, token_for
    from tickloom.engine.model.tiny import write_tiny_model
    from tickloom.engine.model.tokenizer import TokenizerWrapper
    from tickloom.engine.model.types import HostKV, StepResult


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'tickloom.engine.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
