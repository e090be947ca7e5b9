"""A GGUF file's weights for a model, straight from the file: every load reads them there (the cache keeps no
copy), as the file stores them (``quant.RawBlocks``, views of the file's mapping) or, for the few types tickloom
has no block form of, dequantized by the ``gguf`` package.

The weight fingerprint of a GGUF model is ``checkpoint.fingerprint`` over its float32 weights, as it was when the
cache held them as float32 safetensors (so logs recorded then still verify). ``gguf_fingerprint`` computes it one
tensor at a time: no float32 copy of the whole model, at conversion or at a load that finds none stored.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from tickloom.engine.model.arch import expected_shapes
from tickloom.engine.model.checkpoint import fingerprint
from tickloom.engine.model.config import ModelConfig
from tickloom.engine.model.errors import ModelLoadError
from tickloom.engine.model.quant import RawBlocks, Weight


def gguf_model_weights(path: Path, cfg: ModelConfig, *, quantized: bool = True) -> dict[str, Weight]:
    """The tensors ``cfg``'s model needs, under Hugging Face names, checked for presence and shape. ``quantized``:
    whether the model will be (the fallback reader warns about types it must dequantize only then)."""
    from tickloom.engine.model.gguf_blocks import read_gguf_blocks

    got = read_gguf_blocks(path, cfg)
    if got is None:  # only now import the gguf package (0.2 s)
        from tickloom.engine.model.gguf_loader import gguf_weights, open_gguf

        got = gguf_weights(path, open_gguf(path), cfg, quantized=quantized)
    out: dict[str, Weight] = {}
    for name, shape in expected_shapes(cfg).items():
        w = got.get(name)
        if w is None:
            raise ModelLoadError(path, f"missing tensor {name!r}")
        if tuple(w.shape) != shape:
            raise ModelLoadError(path, f"tensor {name!r} has shape {tuple(w.shape)}, expected {shape}")
        out[name] = w
    return out


class _Dequantized(Mapping[str, torch.Tensor]):
    """The weights as float32 tensors, each made when it is read and not kept."""

    def __init__(self, weights: Mapping[str, Weight]) -> None:
        self.weights = weights

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self.weights[name]
        return w.dequantize() if isinstance(w, RawBlocks) else w.float()

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def gguf_fingerprint(cfg: ModelConfig, weights: Mapping[str, Weight]) -> str:
    """``checkpoint.fingerprint`` of the float32 weights, dequantizing one tensor at a time."""
    return fingerprint(cfg, _Dequantized(weights))  # type: ignore[arg-type]
