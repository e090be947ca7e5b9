"""The device side: weights, paged KV cache, paged-attention forward, counter-based sampling,
block copies, loaders and the executors.

Names are exported lazily, so ``import engine.model.stub`` (or ``engine.model.types``) never imports
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "ModelLoadError": "engine.model.errors",
    "ModelConfig": "engine.model.config",
    "StepResult": "engine.model.types",
    "HostKV": "engine.model.types",
    "SamplingSpecLike": "engine.model.types",
    "ModelExecutor": "engine.model.executor",
    "StubExecutor": "engine.model.stub",
    "token_for": "engine.model.stub",
    "LoadedModel": "engine.model.loaders",
    "load_model": "engine.model.loaders",
    "resolve_model": "engine.model.registry",
    "available_models": "engine.model.registry",
    "cache_dir": "engine.model.registry",
    "TokenizerWrapper": "engine.model.tokenizer",
    "write_tiny_model": "engine.model.tiny",
    "LlamaModel": "engine.model.llama",
    "PagedKVCache": "engine.model.kv_cache",
}

__all__ = [
    "HostKV",
    "LlamaModel",
    "LoadedModel",
    "ModelConfig",
    "ModelExecutor",
    "ModelLoadError",
    "PagedKVCache",
    "SamplingSpecLike",
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
    from engine.model.config import ModelConfig
    from engine.model.errors import ModelLoadError
    from engine.model.executor import ModelExecutor
    from engine.model.kv_cache import PagedKVCache
    from engine.model.llama import LlamaModel
    from engine.model.loaders import LoadedModel, load_model
    from engine.model.registry import available_models, cache_dir, resolve_model
    from engine.model.stub import StubExecutor, token_for
    from engine.model.tiny import write_tiny_model
    from engine.model.tokenizer import TokenizerWrapper
    from engine.model.types import HostKV, SamplingSpecLike, StepResult


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'engine.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value
