"""tickloom's own CPU kernels (``cpu_kernels.c``, or ``cpu_kernels_avx2.c`` on CPUs without AVX512): built with
the system C compiler at first use, cached, and called through ctypes (which lets go of the GIL for the call).

- ``matmul``: 4-bit weights times bfloat16 activations (``Int4Linear``'s fast path).
- ``matmul(..., bits=5 or 6)``: the same for 5- and 6-bit weights (GGUF Q5_0, Q5_1, Q5_K; Q6_K), bit planes
  beside the nibbles.
- ``q8_matmul``: 8-bit weights (GGUF Q8_0's form) times bfloat16 activations, float32 out (the LM head).
- ``half_matmul``: 16-bit float weights (GGUF F16 and BF16, reordered into 4-row tiles) times float32 activations.
- ``decode_attention``: decode rows' attention, reading K and V in place from the paged cache.
- ``add_rms_norm``, ``rope_and_store``, ``silu_mul``: a decoder layer's row-wise ops, fused, so that a layer is
  a few calls instead of about twenty torch ops (each costs microseconds before it touches data, which at batch
  1 was a third of the step).
- ``run_layers`` (``cpu_kernels_layers.h``, bound in ``fused.py``): all of a step's layers in one call, the same
  kernels in the same order, for the models whose every layer they take.

Why kernels of our own: a decode step at batch 1 multiplies one activation row by every weight once, so its speed
is how fast weights become products. torch's ``_weight_int4pack_mm_for_cpu`` turns every 4-bit weight into a float
before multiplying (about 18 G multiply-adds/s on one core of this machine, a third of what memory could feed); the
kernel here quantizes the activations to int8 per group of 32 and multiplies 4-bit by 8-bit integers with
AVX512-VNNI, as llama.cpp does for its Q4 formats (about 3.5x torch's speed at batch 1, and faster at every batch).
The weights keep GGUF's own nibble order, so a Q4_0/Q4_1 tensor loads without moving a nibble. Attention at batch 1
was the next cost: torch gathered the context's blocks into a new tensor and ran a flash attention made for long
queries (about 55 us a layer); the kernel reads the blocks where they are (about 15).

Trade-offs, said plainly:
- Activations are rounded to 8 bits per group of 32 (a relative error near 0.5%, between bfloat16's and
  float16's); ``tests/test_model_agreement.py`` holds the default setting to float32, teacher-forced.
- It needs x86-64 with AVX512 F/BW/DQ/VL, VNNI and BF16 (``cpu_kernels.c``) or at least AVX2, FMA and F16C
  (``cpu_kernels_avx2.c``: the same functions, layouts and arithmetic, with no 4-input byte dot product, so a
  row of products costs about twice the instructions; at batch 1 both wait on memory), and a C compiler (``cc``);
  elsewhere, or with ``TICKLOOM_NATIVE=0``, the model runs torch's kernels and ``status()`` says why;
  ``variant()`` says which build runs.
- The library links the OpenMP runtime torch has already loaded (same soname), so its threads are torch's:
  the thread count is ``torch.get_num_threads()`` and the two pools never compete.

The compiled library is cached in ``kernels/`` of the model cache's folder (``registry.cache_dir()``), named by a
hash of the source, the flags and the compiler's version, so a changed source builds anew.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tickloom.engine.model.gguf_quants import BLOCKS, GGML_TYPES
from tickloom.engine.model.packing import (
    GROUP,
    HALF_KINDS,
    HALF_TILE_ROWS,
    Q6_SUPER_BYTES,
    Q8_TILE_BYTES,
    TILE_BYTES,
    TILE_ROWS,
    WIDE_TILE_BYTES,
)
from tickloom.engine.model.registry import cache_dir

_HERE = Path(__file__).parent
# included by both builds
_HEADERS = tuple(_HERE / f"cpu_kernels_{h}.h" for h in ("common", "rowwise", "half", "layers", "pack"))
_COMMON = ["-O3", "-mf16c", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


@dataclasses.dataclass(frozen=True)
class _Build:
    """One build of the kernels: its source, the compiler flags it needs and the CPU features those flags use."""

    name: str
    source: Path
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]


# The first whose features the CPU has is built. Same functions and layouts in both; cpu_kernels_avx2.c says where
# AVX2 must go another way (no VPDPBUSD, 8-lane registers in pairs).
_BUILDS = (
    _Build("avx512", _HERE / "cpu_kernels.c",
           ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", *_COMMON),
           ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "f16c", "fma")),
    _Build("avx2", _HERE / "cpu_kernels_avx2.c", ("-mavx2", *_COMMON), ("avx2", "f16c", "fma")),
)


class _Kernel:
    def __init__(self, lib: ctypes.CDLL, variant: str) -> None:
        self.variant = variant
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.int_matmul = lib.int_matmul  # 4-, 5- and 6-bit tiles: (..., threads, bits, passes, float32 out)
        self.int_matmul.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                    ctypes.c_int]
        self.int_matmul.restype = ctypes.c_int
        self.int_scratch_bytes = lib.int_scratch_bytes
        self.int_scratch_bytes.argtypes = [i64, i64, i64]
        self.int_scratch_bytes.restype = i64
        self.q8_matmul = lib.q8_matmul
        self.q8_matmul.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ctypes.c_int]
        self.q8_matmul.restype = ctypes.c_int
        self.q8_scratch_bytes = lib.q8_scratch_bytes
        self.q8_scratch_bytes.argtypes = [i64, i64]
        self.q8_scratch_bytes.restype = i64
        self.attention = lib.paged_decode_attention
        self.attention.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, ctypes.c_float, ptr,
                                   ptr, ctypes.c_int]
        self.attention.restype = ctypes.c_int
        self.attention_f32 = lib.paged_decode_attention_f32
        self.attention_f32.argtypes, self.attention_f32.restype = self.attention.argtypes, ctypes.c_int
        self.attention_scratch = lib.attn_scratch_floats
        self.attention_scratch.argtypes = [i64] * 5
        self.attention_scratch.restype = i64
        self.add_rms_norm = lib.add_rms_norm
        self.add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float]
        self.add_rms_norm.restype = None
        self.add_rms_norm_f32 = lib.add_rms_norm_f32
        self.add_rms_norm_f32.argtypes = self.add_rms_norm.argtypes
        self.add_rms_norm_f32.restype = None
        self.add_rms_norm_f32_out = lib.add_rms_norm_f32_out
        self.add_rms_norm_f32_out.argtypes, self.add_rms_norm_f32_out.restype = self.add_rms_norm.argtypes, None
        self.rope_and_store = lib.rope_and_store
        self.rope_and_store.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64]
        self.rope_and_store.restype = None
        self.rope_and_store_f32 = lib.rope_and_store_f32
        self.rope_and_store_f32.argtypes, self.rope_and_store_f32.restype = self.rope_and_store.argtypes, None
        self.silu_mul = lib.silu_mul
        self.silu_mul.argtypes = [ptr, i64, i64, ptr]
        self.silu_mul.restype = None
        self.silu_mul_f32 = lib.silu_mul_f32
        self.silu_mul_f32.argtypes, self.silu_mul_f32.restype = self.silu_mul.argtypes, None
        self.half_matmul = lib.half_matmul
        self.half_matmul.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ctypes.c_int]
        self.half_matmul.restype = ctypes.c_int
        self.bf16_matmul = getattr(lib, "bf16_matmul", None)  # the AVX512 build's alone
        if self.bf16_matmul is not None:
            self.bf16_matmul.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int]
            self.bf16_matmul.restype = ctypes.c_int
        # fused.py's whole-step call: the model's and layers' tables (ctypes structures there) by pointer
        self.run_layers = lib.run_layers
        self.run_layers.argtypes = [ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64,
                                    ctypes.c_float, ctypes.c_float, ptr, ctypes.c_int]
        self.run_layers.restype = ctypes.c_int
        self.layers_work_bytes = lib.layers_work_bytes
        self.layers_work_bytes.argtypes = [ptr, ptr, i64, i64, i64]
        self.layers_work_bytes.restype = i64
        # cpu_kernels_pack.h: GGUF blocks into the tiles at load (src, row stride, rows, k, GGML type, out, threads)
        self.pack_gguf_tiles = lib.pack_gguf_tiles
        self.pack_gguf_tiles.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, ctypes.c_int]
        self.pack_gguf_tiles.restype = ctypes.c_int
        self.pack_q8_from_float = lib.pack_q8_from_float
        self.pack_q8_from_float.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
        self.pack_q8_from_float.restype = ctypes.c_int


def status() -> str:
    """``"ready"``, or why the kernel is not used."""
    return _load()[1]


def variant() -> str | None:
    """Which build runs (``"avx512"`` or ``"avx2"``), or None when none does."""
    kernel = _load()[0]
    return None if kernel is None else kernel.variant


def available() -> bool:
    return _load()[0] is not None


@functools.cache
def _load() -> tuple[_Kernel | None, str]:
    if os.environ.get("TICKLOOM_NATIVE", "1") == "0":
        return None, "off (TICKLOOM_NATIVE=0)"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"needs Linux on x86-64, not {platform.system()} on {platform.machine()}"
    flags = _cpu_flags()
    if flags is None:
        return None, "cannot read /proc/cpuinfo for the CPU's features"
    build = choose_build(flags)
    if build is None:
        return None, f"this CPU lacks {', '.join(f for f in _BUILDS[-1].cpu_flags if f not in flags)} (AVX2 at least)"
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc) on PATH"
    try:
        path = _build(cc, build)
        return _Kernel(ctypes.CDLL(str(path)), build.name), "ready"
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        reason = f"building {build.source.name} failed: {str(detail).strip()[:400]}"
        # The CPU could run the kernels, so this is worth saying: the model runs several times slower without them.
        logging.getLogger(__name__).warning("tickloom's CPU kernels are off: %s", reason)
        return None, reason


def choose_build(cpu_flags: set[str]) -> _Build | None:
    """The first build (AVX512, then AVX2) whose features are all among ``cpu_flags`` (/proc/cpuinfo's names)."""
    return next((b for b in _BUILDS if all(f in cpu_flags for f in b.cpu_flags)), None)


def _cpu_flags() -> set[str] | None:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            lines = [line for line in fh if line.startswith("flags")]
    except OSError:
        return None
    return set(lines[0].split(":", 1)[1].split()) if lines else set()


def _build(cc: str, build: _Build) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    source = build.source.read_bytes() + b"".join(h.read_bytes() for h in _HEADERS)
    key = hashlib.sha256(source + " ".join(build.flags).encode() + version.encode()).hexdigest()[:16]
    root = cache_dir() / "kernels"  # the model cache's root: kernels/ beside models/
    out = root / f"cpu_kernels-{build.name}-{key}.so"
    if out.exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *build.flags, "-o", tmp, str(build.source)], capture_output=True, text=True, check=True)
        os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out



def _kernel() -> _Kernel:
    kernel = _load()[0]
    if kernel is None:
        raise RuntimeError(f"tickloom's CPU kernels are not available: {status()}")
    return kernel


def decode_attention(q: torch.Tensor, kv: torch.Tensor, block_index: torch.Tensor, lengths: torch.Tensor,
                     groups: int, scale: float) -> torch.Tensor:
    """Attention of ``rows`` decode queries over their cached context, read in place from the paged cache.

    ``q``: ``rows x heads * head_dim`` with contiguous rows (it may be a column slice of the qkv output); ``kv``:
    one layer of ``PagedKVCache`` (``2 * kv_heads x blocks x block_size x head_dim``, contiguous); both bfloat16 or
    both float32; ``block_index``: ``rows * per_row`` int64 block ids; ``lengths``: ``rows`` int64 context lengths
    (the query's own position included). Returns ``rows x heads * head_dim`` in q's dtype."""
    kernel = _kernel()
    rows = q.shape[0]
    kv_heads2, num_blocks, block_size, head_dim = kv.shape
    kv_heads, per_row = kv_heads2 // 2, block_index.numel() // max(rows, 1)
    if (q.stride(1) != 1 or not kv.is_contiguous() or kv.dtype != q.dtype
            or q.dtype not in (torch.bfloat16, torch.float32)):
        raise ValueError("decode_attention: bfloat16 or float32 inputs, both the same, with contiguous rows")
    out = torch.empty(rows, q.shape[1], dtype=q.dtype)
    scratch = _scratch_at_least(4 * kernel.attention_scratch(rows, kv_heads, groups, per_row * block_size, head_dim))
    fn = kernel.attention_f32 if q.dtype == torch.float32 else kernel.attention
    rc = fn(q.data_ptr(), q.stride(0), kv.data_ptr(), num_blocks, block_size, block_index.data_ptr(), per_row,
            lengths.data_ptr(), rows, kv_heads, groups, head_dim, scale, out.data_ptr(), scratch,
            torch.get_num_threads())
    if rc:
        raise ValueError(f"decode_attention: head_dim {head_dim} (a multiple of 16, at most 256) or a context "
                         f"length outside 1..{per_row * block_size} (rc {rc})")
    return out


def add_rms_norm(x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x += add`` in place (when given), then RMSNorm of ``x`` times ``weight`` (float32), as a new tensor of
    ``out_dtype``. ``x``, ``add``: contiguous ``rows x hidden``, ``hidden`` a multiple of 16, both bfloat16 (the sum
    is rounded to bfloat16) or both float32 (a float32 residual stream: no rounding); a float32 out (a float32
    model's) only from a float32 ``x``."""
    out = torch.empty(x.shape, dtype=out_dtype)
    if add is not None and add.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: x is {x.dtype}, add {add.dtype}")
    kernel = _kernel()
    if out_dtype == torch.float32:
        if x.dtype != torch.float32:
            raise ValueError(f"add_rms_norm: a float32 out from a float32 x, not {x.dtype}")
        fn = kernel.add_rms_norm_f32_out
    else:
        fn = kernel.add_rms_norm_f32 if x.dtype == torch.float32 else kernel.add_rms_norm
    fn(x.data_ptr(), 0 if add is None else add.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
       eps)
    return out


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                   rope_heads: int, kv_heads: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """Rotary embedding on the first ``rope_heads`` heads of each ``qkv`` row, in place, then the row's K and V
    heads stored at cache slot ``slots[r]`` of ``kv`` (one layer of ``PagedKVCache``). ``cos``/``sin_signed``:
    ``positions x head_dim`` tables (``llama.rope_tables``); all bfloat16, or all float32, and contiguous, head_dim
    a multiple of 32."""
    _, num_blocks, block_size, head_dim = kv.shape
    if not qkv.dtype == cos.dtype == sin_signed.dtype == kv.dtype or qkv.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"rope_and_store: one dtype, bfloat16 or float32 (qkv {qkv.dtype}, cos {cos.dtype}, "
                         f"sin {sin_signed.dtype}, kv {kv.dtype})")
    kernel = _kernel()
    fn = kernel.rope_and_store_f32 if qkv.dtype == torch.float32 else kernel.rope_and_store
    fn(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), positions.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(),
       rope_heads, kv_heads, head_dim, slots.data_ptr(), kv.data_ptr(), num_blocks * block_size)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for rows ``[gate, up]`` (contiguous bfloat16 or float32, each half a multiple of 16
    wide), in gate_up's dtype."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    f32 = gate_up.dtype == torch.float32
    if not f32 and gate_up.dtype != torch.bfloat16:
        raise ValueError(f"silu_mul: bfloat16 or float32, not {gate_up.dtype}")
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    (_kernel().silu_mul_f32 if f32 else _kernel().silu_mul)(gate_up.data_ptr(), rows, inter, out.data_ptr())
    return out


def q8_matmul(x: torch.Tensor, tiles: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x`` (``M x K`` bfloat16, contiguous) times a ``pack_q8_tiles`` weight, ``M x N`` float32."""
    m, k = x.shape
    kernel = _kernel()
    y = torch.empty(m, out_features, dtype=torch.float32)
    if kernel.q8_matmul(x.data_ptr(), tiles.data_ptr(), y.data_ptr(), m, out_features, k,
                        _scratch_at_least(kernel.q8_scratch_bytes(m, k)), torch.get_num_threads()):
        raise ValueError(f"q8 kernel: unsupported shape N={out_features}, K={k}")
    return y


def matmul(x: torch.Tensor, tiles: torch.Tensor, out_features: int,
           out_dtype: torch.dtype = torch.bfloat16, bits: int = 4, passes: int = 1) -> torch.Tensor:
    """``x`` (``M x K`` bfloat16, contiguous) times a ``pack_tiles`` weight (``pack_wide_tiles`` for ``bits`` 5 or
    6), ``M x N`` bfloat16 or float32 (the same sums, unrounded). ``passes=2`` rounds ``x`` to 8 bits twice, the
    value and its residual, where a group's step is far above its row's others (``cpu_kernels_common.h``)."""
    m, k = x.shape
    kernel = _kernel()
    y = torch.empty(m, out_features, dtype=out_dtype)
    if kernel.int_matmul(x.data_ptr(), tiles.data_ptr(), y.data_ptr(), m, out_features, k,
                         _scratch_at_least(kernel.int_scratch_bytes(m, k, passes)), torch.get_num_threads(), bits,
                         passes, out_dtype == torch.float32):
        raise ValueError(f"q{bits} kernel: unsupported shape N={out_features}, K={k} or passes {passes}")
    return y


def half_matmul(x: torch.Tensor, tiles: np.ndarray, n: int, kind: str) -> torch.Tensor:
    """``x`` (``M x K`` float32, contiguous) times a ``pack_half_tiles`` weight of ``n`` rows of ``kind`` ("BF16" or
    "F16") bits, ``M x N`` float32."""
    return _half_product("half_matmul", _kernel().half_matmul, x, torch.float32, tiles, n, HALF_KINDS[kind])


def bf16_matmul(x: torch.Tensor, tiles: np.ndarray, n: int) -> torch.Tensor:
    """``x`` (``M x K`` bfloat16, contiguous) times a ``pack_half_tiles`` weight of ``n`` rows of BF16 bits, ``M x N``
    float32: by bfloat16 pair products on the AVX512 build, by ``half_matmul`` of the widened activations on AVX2
    (the same products, summed in another order)."""
    fn = _kernel().bf16_matmul
    if fn is None and x.dtype == torch.bfloat16:
        return half_matmul(x.float(), tiles, n, "BF16")
    return _half_product("bf16_matmul", fn, x, torch.bfloat16, tiles, n)


def _half_product(name: str, fn: Any, x: torch.Tensor, dtype: torch.dtype, tiles: np.ndarray, n: int,
                  *args: int) -> torch.Tensor:
    """``fn`` (a 16-bit-tile matmul of the kernels) on ``x`` of ``dtype``, checked: ``M x N`` float32."""
    m, k = x.shape
    if (x.dtype != dtype or not x.is_contiguous() or tiles.shape[1] * 16 != k or not tiles.flags.c_contiguous
            or tiles.shape[0] * HALF_TILE_ROWS < n):
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype}, tiles {tiles.shape}: wants "
                         f"{str(dtype).removeprefix('torch.')} M x K and the tiles of N x K")
    y = torch.empty(m, n, dtype=torch.float32)
    if fn(x.data_ptr(), tiles.ctypes.data, y.data_ptr(), m, n, k, *args, torch.get_num_threads()):
        raise ValueError(f"{name}: unsupported shape N={n}, K={k}")
    return y


PACKED_TILE_BYTES = {"Q4_0": TILE_BYTES, "Q4_1": TILE_BYTES, "Q4_K": TILE_BYTES, "Q5_0": WIDE_TILE_BYTES[5],
                     "Q5_1": WIDE_TILE_BYTES[5], "Q5_K": WIDE_TILE_BYTES[5], "Q8_0": Q8_TILE_BYTES,
                     "Q6_K": Q6_SUPER_BYTES}
"""The GGUF types ``pack_gguf_tiles`` takes -> the bytes of the tile it makes of them (4-, 5- and 8-bit), or of a
super-block of 8 tiles and its ``d`` (Q6_K: ``packing.pack_q6_tiles``)."""
PACKED_UNIT_K = {"Q6_K": 256}
"""The inputs one unit of ``PACKED_TILE_BYTES`` spans, where not a tile's ``GROUP`` (32)."""
_TYPE_IDS = {name: i for i, name in GGML_TYPES.items()}


def pack_gguf_tiles(kind: str, blocks: np.ndarray, out: torch.Tensor) -> None:
    """A GGUF tensor's raw blocks (``kind`` a ``PACKED_TILE_BYTES`` type; ``N x row bytes`` uint8, each row's bytes
    contiguous, as a view of the file's mapping has them) into ``out``, its tiles (``N/16 x K/unit x`` the kind's
    tile bytes, uint8, contiguous; ``PACKED_UNIT_K``): the bytes ``packing``'s numpy packers make of
    ``gguf_quants``' fields, by C (``cpu_kernels_pack.h``). ``gguf_pack.pack_gguf`` packs a joined weight's parts
    with it."""
    if kind not in PACKED_TILE_BYTES:
        raise ValueError(f"pack_gguf_tiles: no tiles for {kind} (takes {', '.join(PACKED_TILE_BYTES)})")
    if out.dtype != torch.uint8 or out.dim() != 3 or not out.is_contiguous() or out.shape[2] != PACKED_TILE_BYTES[kind]:
        raise ValueError(f"pack_gguf_tiles: out {tuple(out.shape)} {out.dtype} is not contiguous uint8 tiles of "
                         f"{PACKED_TILE_BYTES[kind]} bytes ({kind})")
    n, k = out.shape[0] * TILE_ROWS, out.shape[1] * PACKED_UNIT_K.get(kind, GROUP)
    size, per = BLOCKS[kind]
    want = (n, k // per * size)
    if blocks.dtype != np.uint8 or blocks.shape != want or k % per or (n and blocks.strides[1] != 1):
        raise ValueError(f"pack_gguf_tiles: {kind} blocks {blocks.shape} {blocks.dtype} (row stride "
                         f"{blocks.strides}) do not fill tiles {tuple(out.shape)}: want uint8 {want}, K a multiple "
                         f"of {per}, each row's bytes contiguous")
    if n == 0 or k == 0:
        return
    rc = _kernel().pack_gguf_tiles(blocks.ctypes.data, blocks.strides[0], n, k, _TYPE_IDS[kind], out.data_ptr(),
                                   torch.get_num_threads())
    if rc:
        raise ValueError(f"pack_gguf_tiles: the kernel refused {kind} {n} x {k} (rc {rc})")


def pack_q8_from_float(w: np.ndarray, out: torch.Tensor) -> None:
    """Float32 rows ``w`` (``N x K``, contiguous) into ``out``, the 8-bit kernel's tiles (``N/16 x K/32 x 576``
    uint8), each group of 32 rounded to int8 on its own step: the bytes of ``head.Q8Linear``'s numpy/torch
    rounding into ``packing.pack_q8_tiles``, by C (``cpu_kernels_pack.h``)."""
    n, k = w.shape
    if (w.dtype != np.float32 or not w.flags.c_contiguous or out.dtype != torch.uint8 or not out.is_contiguous()
            or tuple(out.shape) != (n // TILE_ROWS, k // GROUP, Q8_TILE_BYTES) or n % TILE_ROWS or k % GROUP):
        raise ValueError(f"pack_q8_from_float: w {w.shape} {w.dtype} (contiguous float32, rows in 16s, K in 32s) "
                         f"into out {tuple(out.shape)} {out.dtype}")
    if n and _kernel().pack_q8_from_float(w.ctypes.data, n, k, out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"pack_q8_from_float: the kernel refused {n} x {k}")


_scratch = threading.local()


def _scratch_at_least(size: int) -> int:
    """The address of this thread's scratch buffer (the integer kernels' rounded activations, attention's scores),
    grown to ``size`` bytes. Kept between calls: a decode step makes five kernel calls a layer that want scratch,
    and allocating it each time was a good part of a small model's step outside the kernels. One per thread, as
    two threads (a draft model's and the target's) may multiply at once; a kernel's OpenMP threads share their
    caller's."""
    buf: torch.Tensor | None = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < size:
        buf = torch.empty(max(size, 1 << 16), dtype=torch.uint8)
        _scratch.buf = buf
    return buf.data_ptr()
