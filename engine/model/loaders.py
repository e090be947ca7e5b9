"""Loading a Hugging Face-format model directory: config, safetensors (sharded or not), tokenizer.

Loading is contained: it reads only files inside the model directory (an index's shard names and every symlink
are checked, see ``contained``), and it never runs code from a checkpoint: weights are safetensors only (no
pickle, no ``torch.load``), the tokenizer is ``tokenizer.json``, the chat template runs in jinja's sandbox, and
``auto_map`` / remote code in ``config.json`` is never imported.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors import safe_open

from tickloom.engine.model.config import ModelConfig
from tickloom.engine.model.errors import ModelLoadError
from tickloom.engine.model.llama import LlamaModel, expected_shapes
from tickloom.engine.model.quant import Weight, bf16_supported
from tickloom.engine.model.tokenizer import TokenizerWrapper

log = logging.getLogger(__name__)

ModelBuilder = Callable[[ModelConfig, Mapping[str, Weight], torch.dtype, torch.device, str], LlamaModel]
"""What builds the model from the checkpoint's tensors: ``LlamaModel``, or one rank's shard
(``functools.partial(tp.shard_model, rank=r, world=w)``)."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(slots=True)
class LoadedModel:
    model: LlamaModel
    tokenizer: TokenizerWrapper
    config: ModelConfig
    fingerprint: str
    path: Path


CHECKPOINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                    "chat_template.jinja")
"""The files besides the weights that loading reads; each must stay inside the model directory too."""


def _allowed_roots(root: Path) -> list[Path]:
    """Where a model directory's files may live: the directory itself and, for a Hugging Face hub cache snapshot
    (``models--org--name/snapshots/<rev>/``, whose files are symlinks to ``../../blobs/<hash>``), that repo's
    ``blobs`` directory."""
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        roots.append(root.parent.parent / "blobs")
    return roots


def contained(model_dir: Path, name: object, source: Path | None = None) -> Path:
    """``model_dir / name``, refused (``ModelLoadError``) unless it stays inside the model directory.

    ``name`` must be a relative path without ``..`` (so an index cannot name ``/etc/passwd`` or ``../other``),
    and the file it resolves to, through any symlinks, must lie inside the directory (or its hub cache's
    ``blobs``). ``source`` is the file that named it, for the message.
    """
    where = source or model_dir
    if not isinstance(name, str) or not name:
        raise ModelLoadError(where, f"file name {name!r} must be a non-empty string")
    if "\x00" in name:
        raise ModelLoadError(where, f"file name {name!r} contains a NUL byte")
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or windows.root:
        raise ModelLoadError(where, f"file {name!r} is an absolute path; it must be inside the model directory")
    if ".." in posix.parts or ".." in windows.parts:
        raise ModelLoadError(where, f"file {name!r} leaves the model directory ('..')")
    root = model_dir.resolve()
    path = model_dir / name
    target = path.resolve()
    if not any(target.is_relative_to(r) for r in _allowed_roots(root)):
        raise ModelLoadError(where, f"file {name!r} resolves to {target}, outside the model directory {root} "
                                    "(a symlink escapes it)")
    return path


def _shard_files(model_dir: Path) -> list[Path]:
    index = contained(model_dir, "model.safetensors.index.json")
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(index, f"bad safetensors index: {exc!r}") from exc
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(index, "bad safetensors index: weight_map must be a non-empty object")
        names = set(weight_map.values())
        for name in names:
            if not isinstance(name, str) or not name.endswith(".safetensors"):
                raise ModelLoadError(index, f"shard {name!r} in weight_map is not a .safetensors file name")
        files = sorted(contained(model_dir, name, index) for name in names)
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f, "shard named in model.safetensors.index.json is missing")
        return files
    files = sorted(contained(model_dir, f.name) for f in model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(model_dir, "no *.safetensors weights found")
    return files


def read_safetensors(model_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of a checkpoint directory and, per tensor, the file it came from."""
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in _shard_files(model_dir):
        size = f.stat().st_size
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensors[name] = sf.get_tensor(name)
                    origin[name] = f
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f, f"truncated or corrupt safetensors file ({size} bytes): {exc}") from exc
    return tensors, origin


def check_tensors(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], origin: dict[str, Path], where: Path
) -> dict[str, torch.Tensor]:
    """The tensors the architecture needs, checked for presence and shape."""
    out: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        t = tensors.get(name)
        if t is None:
            raise ModelLoadError(where, f"missing tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ModelLoadError(
                origin.get(name, where), f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}"
            )
        if not t.is_floating_point():
            raise ModelLoadError(origin.get(name, where), f"tensor {name!r} has non-float dtype {t.dtype}")
        out[name] = t
    return out


def fingerprint(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> str:
    """blake2b over the canonical config and every weight's name, dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).reshape(-1).numpy().data if t.numel() else b"")
    return h.hexdigest()


def _fingerprint_files(model_dir: Path) -> list[str]:
    """The files a weight fingerprint depends on, relative to the directory: config.json, the shard index and
    the shards."""
    names = ["config.json", *(str(f.relative_to(model_dir)) for f in _shard_files(model_dir))]
    if (model_dir / "model.safetensors.index.json").is_file():
        names.append("model.safetensors.index.json")
    return names


def _identities(model_dir: Path, names: list[str]) -> dict[str, list[int]]:
    from tickloom.engine.model.registry import file_identity

    out = {}
    for n in names:
        try:
            out[n] = file_identity(model_dir / n)
        except OSError as exc:
            raise ModelLoadError(model_dir / n, f"cannot read: {exc}") from exc
    return out


def stored_fingerprint(model_dir: Path) -> str | None:
    """The weight fingerprint recorded for this directory, if it still holds: a converted cache entry's
    ``tickloom.json`` (its files' sizes unchanged), else the cache index's record for the directory (every
    file's identity unchanged). None if there is none, so the caller computes it."""
    from tickloom.engine.model.registry import cache_dir, read_index, read_meta

    real = model_dir.resolve()
    if real.is_relative_to((cache_dir() / "models").resolve()):  # a user's directory cannot vouch for itself
        meta = read_meta(real)
        if meta is not None:
            fp, sizes = meta.get("fingerprint"), meta.get("files")
            if (isinstance(fp, str) and isinstance(sizes, dict) and "model.safetensors" in sizes
                    and all((real / str(n)).is_file() and (real / str(n)).stat().st_size == size
                            for n, size in sizes.items())):
                return fp
    record = read_index()["dirs"].get(str(real))
    if not isinstance(record, dict) or not isinstance(record.get("fingerprint"), str):
        return None
    names = _fingerprint_files(model_dir)
    if record.get("files") != _identities(model_dir, names):
        return None
    return str(record["fingerprint"])


def _remember_fingerprint(model_dir: Path, identities: dict[str, list[int]], fp: str) -> None:
    from tickloom.engine.model.registry import locked_index

    if _identities(model_dir, list(identities)) != identities:
        return  # the files changed while they were read: remember nothing
    try:
        with locked_index() as index:
            index["dirs"][str(model_dir.resolve())] = {"files": identities, "fingerprint": fp}
    except OSError as exc:  # a read-only cache costs a hash at each load, nothing more
        log.warning("cannot remember the weight fingerprint of %s in the tickloom cache: %s", model_dir, exc)


def load_hf_dir(
    model_dir: Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    quant: str = "none",
    gguf: Path | None = None,
    build: ModelBuilder = LlamaModel,
) -> LoadedModel:
    """``gguf``: the file ``model_dir`` was converted from; with a ``quant`` setting its Q4_0/Q4_1/Q8_0 blocks
    are read straight from it (no float32 weights are read or made). The fingerprint gains ``+<quant>``; it is the
    whole checkpoint's, whatever ``build`` makes of it."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(model_dir, "not a directory")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    dt = parse_dtype(dtype, dev)
    for name in CHECKPOINT_FILES:  # read below only if present; each must stay inside the directory
        contained(model_dir, name)
    cfg = ModelConfig.from_file(model_dir / "config.json")
    fp = stored_fingerprint(model_dir)
    identities = _identities(model_dir, _fingerprint_files(model_dir)) if fp is None else {}
    needed: dict[str, Weight]
    if gguf is not None and quant != "none" and fp is not None:
        needed = _gguf_weights(gguf, cfg)
    else:
        tensors, origin = read_safetensors(model_dir)
        needed = dict(check_tensors(cfg, tensors, origin, model_dir))
    tok = TokenizerWrapper.from_dir(model_dir)
    if fp is None:
        log.info("computing the weight fingerprint of %s (once per checkpoint)…", model_dir)
        fp = fingerprint(cfg, {k: v for k, v in needed.items() if isinstance(v, torch.Tensor)})
        _remember_fingerprint(model_dir, identities, fp)
    if tok.vocab_size > cfg.vocab_size:
        raise ModelLoadError(
            model_dir / "tokenizer.json",
            f"tokenizer has {tok.vocab_size} tokens, model vocab_size is {cfg.vocab_size}",
        )
    if not tok.eos_token_ids and cfg.eos_token_ids:
        tok.eos_token_ids = cfg.eos_token_ids
    model = build(cfg, needed, dt, dev, quant)
    if quant != "none":
        fp = f"{fp}+{quant}"
    return LoadedModel(model=model, tokenizer=tok, config=cfg, fingerprint=fp, path=model_dir)


def _gguf_weights(path: Path, cfg: ModelConfig) -> dict[str, Weight]:
    from tickloom.engine.model.gguf_blocks import read_gguf_blocks

    got = read_gguf_blocks(path, cfg)
    if got is None:  # only now import the gguf package (0.2 s)
        from tickloom.engine.model.gguf_loader import gguf_weights, open_gguf

        got = gguf_weights(path, open_gguf(path), cfg)
    out: dict[str, Weight] = {}
    for name, shape in expected_shapes(cfg).items():
        w = got.get(name)
        if w is None:
            raise ModelLoadError(path, f"missing tensor {name!r}")
        if tuple(w.shape) != shape:
            raise ModelLoadError(path, f"tensor {name!r} has shape {tuple(w.shape)}, expected {shape}")
        out[name] = w
    return out


def split_setting(dtype: str | torch.dtype | None, quant: str | None) -> tuple[str | torch.dtype | None, str | None]:
    """``"bfloat16+int4"`` (how a log's header records a quantized model's dtype) is dtype and quant in one."""
    if isinstance(dtype, str) and "+" in dtype:
        dtype, _, q = dtype.partition("+")
        if quant is not None and quant != q:
            raise ValueError(f"dtype {dtype}+{q} contradicts quant {quant!r}")
        quant = q
    return dtype, quant


def default_setting(path_or_name: str | os.PathLike[str], device: torch.device) -> tuple[str | None, str]:
    """(dtype, quant) when neither is given: for the bundled model on a CPU with native bfloat16, bfloat16
    activations and int4 weights packed from its Q4_1 blocks (the fastest setting that passes
    tests/test_model_agreement.py); for every other model, float32 on CPU (bfloat16 on CUDA), unquantized."""
    from tickloom.engine.model.registry import DEFAULT_MODEL

    if str(path_or_name) == DEFAULT_MODEL and device.type == "cpu" and bf16_supported():
        return DEFAULT_SETTING
    return None, "none"


DEFAULT_SETTING = ("bfloat16", "int4")
"""The bundled model's setting on a CPU with native bfloat16 (``default_setting``)."""


def _source_gguf(path_or_name: str | os.PathLike[str]) -> Path | None:
    from tickloom.engine.model.registry import DEFAULT_MODEL, smollm2_gguf_path

    if str(path_or_name) == DEFAULT_MODEL:
        return smollm2_gguf_path()
    p = Path(path_or_name).expanduser()
    return p if p.suffix == ".gguf" and p.is_file() else None


def _release_heap() -> None:
    """Hand the loader's freed temporaries back to the OS (glibc keeps them otherwise: ~250 MB of RSS after a
    quantized load)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        return


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """The cycle collector paused: a load makes thousands of short-lived objects, and with torch imported each
    full collection walks ~170,000 live ones (~50 ms, once or twice per load). A load makes no cycles to collect."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _use_cores(num_threads: int | None) -> None:
    """``num_threads``, else every core this process may run on, unless torch's thread count was already
    chosen: ``OMP_NUM_THREADS`` is set, or it is 1 (tests pin 1; a deliberate 1 is kept)."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
        return
    if "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() == 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores > torch.get_num_threads():
        torch.set_num_threads(cores)


def load_model(
    path_or_name: str | os.PathLike[str],
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    num_threads: int | None = None,
    quant: str | None = None,
    *,
    build: ModelBuilder = LlamaModel,
) -> LoadedModel:
    """Load ``smollm2-135m``, a Hugging Face model directory, or a ``.gguf`` file (``build``: see ``ModelBuilder``).

    Progress goes to the ``engine.model`` logger at INFO ("loading ...", a first run's conversion, "loaded ...
    in X s"); the command line shows it on stderr."""
    from tickloom.engine.model.registry import resolve_model

    _use_cores(num_threads)
    started = time.monotonic()
    dtype, quant = split_setting(dtype, quant)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dtype is None and quant is None:
        dtype, quant = default_setting(path_or_name, dev)
    quant = quant or "none"
    if dtype is None and quant != "none" and dev.type == "cpu":
        dtype = "bfloat16"  # the quantized kernels take 16-bit activations
    log.info("loading %s%s…", path_or_name, "" if quant == "none" else f" ({quant})")
    with _no_gc():
        loaded = load_hf_dir(resolve_model(path_or_name), dtype, device, quant, _source_gguf(path_or_name), build)
    _release_heap()
    log.info("loaded %s in %.1f s", path_or_name, time.monotonic() - started)
    return loaded
