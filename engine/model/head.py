"""The LM head's forms under a quantized setting: ``Q8Linear`` on tickloom's 8-bit kernel where it runs (GGUF
Q8_0 as the file has it), else ``DynInt8Linear`` on fbgemm (x86 torch), else ``quant.Int8Linear``.

Why the head has its own forms: it is the largest single matmul of a small model (49152 x 576 for SmolLM2) and its
input has a few channels 15-20 times the row's rms, so it takes finer activations than the layers (see each class).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tickloom.engine.model import gguf_pack, gguf_quants, native, packing
from tickloom.engine.model.quant import (
    Int8Linear,
    Linear,
    RawBlocks,
    Weight,
    _nbytes,
    gguf_q8_0,
    join_linear,
    q8_0_rows,
)


def int8_rows(w: Weight, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Any weight as symmetric int8 ``N x K`` (-127..127) and float32 scales, one per row. GGUF blocks of other
    types than Q8_0 (a Q4_K_M file's Q6_K head) are dequantized ``chunk`` rows at a time, so the float32 head
    (131 MB for 32000 x 1024) is never whole in memory; the rounding is ``Int8Linear.from_float``'s."""
    if isinstance(w, RawBlocks) and w.kind == "Q8_0":
        return q8_0_rows(w.data)
    if isinstance(w, RawBlocks):
        n = w.shape[0]
        q = np.empty(w.shape, dtype=np.int8)
        scales = np.empty(n, dtype=np.float32)
        for lo in range(0, n, chunk):
            f = gguf_quants.dequantize(w.kind, w.data[lo : lo + chunk])
            s = np.maximum(np.abs(f).max(axis=1) / np.float32(127.0), np.float32(1e-12))
            q[lo : lo + chunk] = np.clip(np.rint(f / s[:, None]), -127, 127)
            scales[lo : lo + chunk] = s
        return torch.from_numpy(q), torch.from_numpy(scales)
    lin = Int8Linear.from_float(w, act=torch.float32)
    return lin.q, lin.scales


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines and _fbgemm_op() is not None


def _vnni() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            return "avx512_vnni" in fh.read(1 << 16)
    except OSError:
        return False


def _fbgemm_op() -> Any:
    try:  # registered by every x86 build; absent from some others, which then never build a DynInt8Linear
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default
    except (AttributeError, RuntimeError):
        return None


_QLINEAR: Callable[[torch.Tensor, float, int, Any], torch.Tensor] = _fbgemm_op()
_LEVELS = 127 if _vnni() else 63
"""Activation steps each side of zero. fbgemm multiplies uint8 activations by int8 weights; without VNNI it sums
pairs of products in int16, which saturates past 32767 (255 * 127 * 2 does), so there it gets 7-bit activations
(127 * 127 * 2 does not)."""
_TINY = 1e-30


class DynInt8Linear:
    """int8 weights (one scale per output row), packed once for fbgemm; each call quantizes the activations per
    row and runs fbgemm's integer GEMM, which returns float32.

    Why: on x86 torch's weight-only kernels convert every weight to float per call, so at batch 1 the 49152-row
    LM head took 6 ms in int8 (int4: 2 ms), while fbgemm's uint8 x int8 GEMM reads the same bytes in under 1 ms,
    and its advantage grows with the batch.

    Why two passes: one 8-bit step per row is too coarse for this head's input (a few channels are 15-20 times
    the row's rms, so most values get 3 bits: greedy agreement with float32 fell to 90%). Each row ``x`` is
    split into ``s1 * (hi + s2 * lo)``, ``hi`` on the 8-bit grid and ``lo`` the rounding residual on its own
    8-bit grid, and both go through one GEMM of twice the rows (at small batches it costs the same: the weights
    are read once). That is ~16 bits per activation, finer than bfloat16. ``hi`` is rounded here, so fbgemm's
    own rounding (with the fixed scale ``1 / _LEVELS``) leaves it as it is and the residual is exact.

    Deterministic and independent of the batch: the scales are per row and the GEMM accumulates in int32."""

    __slots__ = ("bias", "in_features", "out_features", "packed")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        n = q.shape[0]
        self.out_features, self.in_features = q.shape
        self.bias = None if bias is None else bias.float()
        with warnings.catch_warnings():  # quantized tensors are deprecated as a user API; fbgemm's ops are not
            warnings.simplefilter("ignore")
            qt = torch._make_per_channel_quantized_tensor(q.contiguous(), scales.double(),
                                                          torch.zeros(n, dtype=torch.long), 0)
            engine = torch.backends.quantized.engine
            torch.backends.quantized.engine = "fbgemm"
            try:
                self.packed = torch.ops.quantized.linear_prepack(qt, None)
            finally:
                torch.backends.quantized.engine = engine

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = tuple(x.shape[:-1])
        xf = x.reshape(-1, self.in_features).float()
        m = xf.shape[0]
        inf = float("inf")
        s1 = torch.linalg.vector_norm(xf, inf, dim=1, keepdim=True).clamp_(min=_TINY)
        parts = torch.empty(2 * m, self.in_features)
        hi, lo = parts[:m], parts[m:]
        torch.div(xf, s1, out=lo)
        torch.round(lo * _LEVELS, out=hi).div_(_LEVELS)
        lo.sub_(hi)
        s2 = torch.linalg.vector_norm(lo, inf, dim=1, keepdim=True).clamp_(min=_TINY)
        lo.div_(s2)
        y = _QLINEAR(parts, 1.0 / _LEVELS, _LEVELS + 1, self.packed)
        out = torch.addcmul(y[:m], y[m:], s2).mul_(s1)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*lead, self.out_features)

    def nbytes(self) -> int:
        return self.out_features * (self.in_features + 4)


class Q8Linear:
    """GGUF Q8_0's form, ``w[n, k] = d[n, k // 32] * q[n, k]`` with ``q`` int8, on tickloom's 8-bit kernel
    (``engine.model.native.q8_matmul``); returns float32. The LM head where the kernel runs: a Q8_0 head (the
    bundled model's tied embedding) is used as the file has it, with no second rounding."""

    __slots__ = ("in_features", "out_features", "tiles")

    def __init__(self, tiles: torch.Tensor) -> None:
        """The head of ``packing.pack_q8_tiles``' tiles as they are (``N/16 x K/32 x 576``)."""
        self.tiles = tiles
        self.out_features, self.in_features = packing.TILE_ROWS * tiles.shape[0], packing.GROUP * tiles.shape[1]

    @classmethod
    def from_fields(cls, q: np.ndarray, d: np.ndarray) -> Q8Linear:
        """``q`` ``N x K`` int8, ``d`` ``N x K/32`` float32: packed into the kernel's tiles."""
        return cls(packing.pack_q8_tiles(q, d))

    @classmethod
    def from_weight(cls, w: Weight, chunk: int = 4096) -> Q8Linear:
        """Q8_0 and Q5_0 blocks as they are (their scales are float16 already); any other weight rounded to 8 bits
        per 32, GGUF blocks ``chunk`` rows at a time (a Q4_K_M file's Q6_K head is never whole in float32)."""
        if isinstance(w, RawBlocks) and w.kind == "Q8_0" and gguf_pack.packs([(w.kind, w.data)]):
            return cls(gguf_pack.pack_gguf([(w.kind, w.data)]))  # the file's blocks, in C
        if isinstance(w, RawBlocks) and w.kind == "Q8_0":
            d8, q8 = gguf_q8_0(w.data)
            return cls.from_fields(q8.reshape(q8.shape[0], -1), d8)
        if isinstance(w, RawBlocks) and w.kind == "Q5_0":
            q5, d5, _, _ = gguf_quants.int8_fields(w.kind, w.data)
            return cls.from_fields(q5, d5)
        n, k = w.shape
        rows = chunk if isinstance(w, RawBlocks) else n
        t = packing.TILE_ROWS
        if gguf_pack.enabled() and n % t == 0 and rows % t == 0:  # the same rounding and tiles, in C
            tiles = packing.tile_buffer(n // t, k // packing.GROUP, packing.Q8_TILE_BYTES)
            for lo in range(0, n, rows):
                part = (gguf_quants.dequantize(w.kind, w.data[lo : lo + rows]) if isinstance(w, RawBlocks)
                        else w.float().contiguous().numpy())
                native.pack_q8_from_float(np.ascontiguousarray(part, dtype=np.float32),
                                          tiles[lo // t : (lo + part.shape[0]) // t])
            return cls(tiles)
        q = np.empty((n, k), dtype=np.int8)
        step = np.empty((n, k // 32), dtype=np.float32)
        for lo in range(0, n, rows):
            if isinstance(w, RawBlocks):
                f = torch.from_numpy(gguf_quants.dequantize(w.kind, w.data[lo : lo + rows]))
            else:
                f = w.float()
            m = f.shape[0]
            groups = f.reshape(m, k // 32, 32)
            s = groups.abs().amax(dim=-1) / 127.0
            q[lo : lo + m] = torch.round(groups / s.clamp(min=1e-30)[..., None]).clamp(-127, 127).to(
                torch.int8).reshape(m, k).numpy()
            step[lo : lo + m] = s.numpy()
        return cls.from_fields(q, step)

    def dequantize(self) -> torch.Tensor:
        t = self.tiles.numpy()
        q = packing.q8_tile_integers(t)
        d = packing.q8_tile_scales(t)
        return torch.from_numpy((q.astype(np.float32) * d[..., None]).reshape(q.shape[0], -1))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = tuple(x.shape[:-1])
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        return native.q8_matmul(x2, self.tiles, self.out_features).view(*lead, self.out_features)

    def nbytes(self) -> int:
        return _nbytes(self.tiles)


def head_linear(w: Weight, quant: str, act: torch.dtype) -> Linear:
    """The LM head under a model setting: dense with ``"none"``; else ``Q8Linear`` where tickloom's kernels
    run, else ``DynInt8Linear`` where fbgemm runs, else weight-only int8. Never int4: an int4 head costs about a
    tenth of the greedy agreement with float32 on SmolLM2-135M (llama.cpp's Q4 files keep a Q8_0 head too)."""
    if quant == "none":
        return join_linear([w], None, quant, act)
    if native.available() and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0:
        return Q8Linear.from_weight(w)
    if fbgemm_available():
        return DynInt8Linear(*int8_rows(w))
    return join_linear([w], None, "int8", act)
