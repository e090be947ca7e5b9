"""Loading a model: a name, a Hugging Face-format directory or a ``.gguf`` file (``convert.resolve_model``), as
config, weights (float, or quantized straight from the GGUF's blocks), tokenizer and weight fingerprint.

Loading is contained: every file is read through ``checkpoint`` (see ``checkpoint.contained``), and it never runs
code from a checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tickloom.engine.model.arch import text_model_names
from tickloom.engine.model.checkpoint import (
    CHECKPOINT_FILES,
    check_tensors,
    contained,
    fingerprint,
    fingerprint_files,
    read_safetensors,
)
from tickloom.engine.model.config import ModelConfig
from tickloom.engine.model.convert import model_source, resolve_model
from tickloom.engine.model.errors import ModelLoadError
from tickloom.engine.model.gguf_weights import gguf_fingerprint, gguf_model_weights
from tickloom.engine.model.llama import LlamaModel
from tickloom.engine.model.quant import Weight, bf16_runs_fast
from tickloom.engine.model.registry import (
    META_FILE,
    cache_dir,
    file_identity,
    locked_index,
    read_index,
    read_meta,
)
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


def _identities(model_dir: Path, names: list[str]) -> dict[str, list[int]]:
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
    real = model_dir.resolve()
    fp = _entry_fingerprint(real)
    if fp is not None:
        return fp
    record = read_index()["dirs"].get(str(real))
    if not isinstance(record, dict) or not isinstance(record.get("fingerprint"), str):
        return None
    names = fingerprint_files(model_dir)
    if record.get("files") != _identities(model_dir, names):
        return None
    return str(record["fingerprint"])


def _entry_fingerprint(real: Path) -> str | None:
    """A cache entry's recorded fingerprint, if its files' sizes are unchanged (a GGUF's entry: its weights are
    the GGUF's, whose content names the entry)."""
    if not real.is_relative_to((cache_dir() / "models").resolve()):  # a user's directory cannot vouch for itself
        return None
    meta = read_meta(real)
    if meta is None:
        return None
    fp, sizes = meta.get("fingerprint"), meta.get("files")
    if (isinstance(fp, str) and isinstance(sizes, dict) and "config.json" in sizes
            and all((real / str(n)).is_file() and (real / str(n)).stat().st_size == size
                    for n, size in sizes.items())):
        return fp
    return None


def _remember_fingerprint(model_dir: Path, identities: dict[str, list[int]], fp: str) -> None:
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
    """``gguf``: the file ``model_dir`` (its cache entry: config and tokenizer, no weights) was converted from;
    the weights are read from it as it stores them (``gguf_weights.gguf_model_weights``: no float32 copy unless
    the setting is float32). The fingerprint gains ``+<quant>``; it is the whole checkpoint's, whatever
    ``build`` makes of it."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(model_dir, "not a directory")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    dt = parse_dtype(dtype, dev)
    for name in CHECKPOINT_FILES:  # read below only if present; each must stay inside the directory
        contained(model_dir, name)
    cfg = ModelConfig.from_file(model_dir / "config.json")
    needed: dict[str, Weight]
    if gguf is not None:
        needed = gguf_model_weights(gguf, cfg, quantized=quant != "none")
        fp = _entry_fingerprint(model_dir.resolve())
        if fp is None:
            log.info("computing the weight fingerprint of %s…", gguf)
            fp = gguf_fingerprint(cfg, needed)
    else:
        _refuse_weightless_entry(model_dir)
        fp = stored_fingerprint(model_dir)
        identities = _identities(model_dir, fingerprint_files(model_dir)) if fp is None else {}
        tensors, origin = read_safetensors(model_dir)
        tensors, origin = text_model_names(tensors), text_model_names(origin)
        needed = dict(check_tensors(cfg, tensors, origin, model_dir))
        if fp is None:
            log.info("computing the weight fingerprint of %s (once per checkpoint)…", model_dir)
            fp = fingerprint(cfg, {k: v for k, v in needed.items() if isinstance(v, torch.Tensor)})
            _remember_fingerprint(model_dir, identities, fp)
    tok = TokenizerWrapper.from_dir(model_dir)
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


def _refuse_weightless_entry(model_dir: Path) -> None:
    """A GGUF's cache entry given as a directory: its weights are in the GGUF, so say which file to load."""
    if any(model_dir.glob("*.safetensors")) or not (model_dir / META_FILE).is_file():
        return
    meta = read_meta(model_dir) or {}
    if meta.get("weights") == "gguf":
        raise ModelLoadError(model_dir, f"a tickloom cache entry holds no weights: load the GGUF it was converted "
                                        f"from ({meta.get('source', 'its .gguf file')})")


def split_setting(dtype: str | torch.dtype | None, quant: str | None) -> tuple[str | torch.dtype | None, str | None]:
    """``"bfloat16+int4"`` (how a log's header records a quantized model's dtype) is dtype and quant in one."""
    if isinstance(dtype, str) and "+" in dtype:
        dtype, _, q = dtype.partition("+")
        if quant is not None and quant != q:
            raise ValueError(f"dtype {dtype}+{q} contradicts quant {quant!r}")
        quant = q
    return dtype, quant


def default_setting(path_or_name: str | os.PathLike[str], device: torch.device) -> tuple[str | None, str]:
    """(dtype, quant) when neither is given. A GGUF, by name or by path alike, on a CPU where that runs fast
    (``quant.bf16_runs_fast``: tickloom's kernels, AVX2 at least, or native bfloat16):
    the file's own quantization when its matrices are quantized (``DEFAULT_SETTING``: bfloat16 activations, Q4
    blocks as int4 and 5- to 8-bit ones as grouped int8, each as the file stores it; the bundled model's setting,
    the fastest that passes tests/test_model_agreement.py). Every other model, and any model elsewhere: float32
    on CPU (bfloat16 on CUDA), unquantized."""
    if device.type != "cpu" or not bf16_runs_fast():
        return None, "none"
    gguf = _source_gguf(path_or_name)
    if gguf is not None and gguf_is_quantized(gguf):
        return DEFAULT_SETTING
    return None, "none"


DEFAULT_SETTING = ("bfloat16", "int4")
"""A quantized GGUF's setting on a CPU where it runs fast (``default_setting``)."""


def gguf_is_quantized(path: Path) -> bool:
    """Whether any of the file's matrices has an integer type (read from the tensor directory alone)."""
    from tickloom.engine.model.gguf_blocks import read_gguf_header

    header = read_gguf_header(path)
    if header is None:
        return False
    return any(len(t.shape) == 2 and t.type_name not in ("F32", "F16", "BF16", "F64") for t in header.tensors)


def _source_gguf(path_or_name: str | os.PathLike[str]) -> Path | None:
    """The GGUF file a name or path loads from (the bundled one, a path, a Hugging Face cache snapshot's), if any."""
    try:
        src = model_source(path_or_name)
    except ModelLoadError:
        return None
    return src if src.suffix == ".gguf" and src.is_file() else None


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
