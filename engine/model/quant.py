"""Weight-only quantized linear layers for CPU: int8 per output channel, int4 in groups along the input axis.

Both run torch's own kernels with bfloat16 (or float16) activations; float32 activations are cast for the
matmul and the result cast back (torch has no fast float32 path for these ops):

- ``Int8Linear``: ``aten._weight_int8pack_mm(x, q, scales)``: ``w[n, k] = q[n, k] * scales[n]``, ``q`` int8.
- ``Int4Linear``: ``w[n, k] = s[n, g] * q[n, k] + z[n, g]``, ``q`` in 0..15, ``g = k // group``; a GGUF Q4_1
  block (``w = d * q + m``) is exactly ``s = d, z = m``, Q4_0 (``w = d (q - 8)``) is ``s = d, z = -8 d``. It runs
  tickloom's own kernel (``engine.model.native``, which keeps GGUF's nibble order) where the CPU has it, else
  ``aten._weight_int4pack_mm_for_cpu`` (weights packed by ``engine.model.int4pack``, ``scales_and_zeros``
  ``[K / group, N, 2]`` in the activation dtype, ``w = (q - 8) * scale + zero``: ``zero = z + 8 s``).

The LM head of a quantized model has its own forms (``engine.model.head``).

``QUANT_SETTINGS`` names the settings ``EngineConfig.quant`` accepts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from tickloom.engine.model import gguf_pack, gguf_quants, int4pack, native, packing
from tickloom.engine.model.file_pages import drop_file_pages
from tickloom.engine.model.quant_grouped import GroupedInt8Linear, HalfLinear, SplitLinear, WideIntLinear

QUANT_SETTINGS: dict[str, tuple[int, int]] = {
    "none": (0, 0),
    "int8": (8, 0),
    "int4": (4, 32),
}
"""Setting -> (bits, group size); 0 bits: dense weights in the model dtype. Groups of 64 and 128 work (the
kernel takes them) but are not offered: requantizing the bundled model's Q4_1 weights to them drops its greedy
agreement with float32 to 78% and 75%."""

_INT4_MM: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor] = (
    torch.ops.aten._weight_int4pack_mm_for_cpu.default
)  # the overloads: less Python per call
_INT8_MM: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = (
    torch.ops.aten._weight_int8pack_mm.default
)


class Linear(Protocol):
    """``y = x @ w.T (+ b)`` for ``x`` of shape ``... x in_features``."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def nbytes(self) -> int: ...


class DenseLinear:
    __slots__ = ("bias", "in_features", "out_features", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        return _nbytes(self.weight, self.bias)


def _nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _matmul_2d(x: torch.Tensor, act: torch.dtype, in_features: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    lead = tuple(x.shape[:-1])
    return x.reshape(-1, in_features).to(act).contiguous(), lead


class Int8Linear:
    """Weight-only int8, one scale per output channel (symmetric, ``q`` in -127..127)."""

    __slots__ = ("act", "bias", "in_features", "out_features", "q", "scales")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, act: torch.dtype) -> None:
        self.q, self.scales, self.act = q.contiguous(), scales.to(act).contiguous(), act
        self.bias = None if bias is None else bias.to(act)
        self.out_features, self.in_features = q.shape

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None,
                   act: torch.dtype = torch.bfloat16) -> Int8Linear:
        w = w.float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales, bias, act)

    @classmethod
    def from_q8_0(cls, blocks: np.ndarray, bias: torch.Tensor | None = None,
                  act: torch.dtype = torch.bfloat16) -> Int8Linear:
        """GGUF Q8_0 rows (a scale per 32) onto one scale per row, the row's largest block scale: each value moves
        by at most half a step of that scale."""
        return cls(*q8_0_rows(blocks), bias, act)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == self.act and self.bias is None and x.is_contiguous():
            return _INT8_MM(x, self.q, self.scales)  # the forward's case: no reshapes, no casts
        x2, lead = _matmul_2d(x, self.act, self.in_features)
        y = _INT8_MM(x2, self.q, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features).to(x.dtype)

    def nbytes(self) -> int:
        return _nbytes(self.q, self.scales, self.bias)


def q8_0_rows(blocks: np.ndarray, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 rows (a scale per 32) onto int8 ``N x K`` with one scale per row, the row's largest block scale:
    each value moves by at most half a step of that scale. Done ``chunk`` rows at a time, so the float
    temporaries stay in cache (the whole 49152-row head at once took 2.5x as long)."""
    n = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(n, -1, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    scales = np.maximum(np.abs(d).max(axis=1), np.float32(1e-12))
    ratio = (d / scales[:, None])[..., None]  # |ratio| <= 1, so |q * ratio| <= 127: no clamp needed
    q = np.empty((n, b.shape[1], 32), dtype=np.int8)
    for lo in range(0, n, chunk):
        part = b[lo : lo + chunk, :, 2:].view(np.int8)
        q[lo : lo + chunk] = np.rint(part * ratio[lo : lo + chunk])
    return torch.from_numpy(q.reshape(n, -1)), torch.from_numpy(scales)


class Int4Linear:
    """Weight-only asymmetric int4 in groups of ``group`` input features: ``w[n, k] = s[n, g] * q[n, k] + z[n, g]``
    with ``q`` in 0..15 and ``g = k // group`` (GGUF Q4_1's own form).

    Two kernels: tickloom's (``engine.model.native``: groups of 32, bfloat16 activations, output rows in
    sixteens, on CPUs with AVX512-VNNI/BF16), else torch's ``_weight_int4pack_mm_for_cpu``. ``use_native=False``
    forces torch's; only the chosen one's weight is kept."""

    __slots__ = ("act", "bias", "group", "in_features", "out_features", "packed", "passes", "scales_zeros", "tiles")

    def __init__(self, in_features: int, out_features: int, group: int, bias: torch.Tensor | None, act: torch.dtype,
                 *, tiles: torch.Tensor | None = None, packed: torch.Tensor | None = None,
                 scales_zeros: torch.Tensor | None = None) -> None:
        """The layer from its weight as one kernel takes it: tickloom's ``tiles`` (``packing.pack_tiles``'), or
        torch's ``packed`` nibbles and ``scales_zeros``. ``from_fields`` and the other constructors make them."""
        if (tiles is not None) == (packed is not None) or (packed is None) != (scales_zeros is None):
            raise ValueError("int4: give the kernel's tiles, or torch's packed nibbles and scales, not both")
        self.in_features, self.out_features, self.group, self.act = in_features, out_features, group, act
        self.bias = None if bias is None else bias.to(act)
        self.tiles, self.packed, self.scales_zeros = tiles, packed, scales_zeros
        self.passes = 1  # the activations' 8-bit passes on tickloom's kernel; LayerWeights sets 2

    @classmethod
    def from_fields(cls, nibbles: np.ndarray, s: np.ndarray, z: np.ndarray, group: int, bias: torch.Tensor | None,
                    act: torch.dtype, use_native: bool | None = None) -> Int4Linear:
        """``nibbles``: ``N x K/32 x 16`` bytes in GGUF order (byte ``j`` of block ``b`` holds input ``32 b + j`` in
        its low nibble and ``32 b + 16 + j`` in its high one); ``s``, ``z``: ``N x K/group`` float32. Packed for
        tickloom's kernel where it runs (``use_native`` None), else for torch's."""
        n, k = nibbles.shape[0], 32 * nibbles.shape[1]
        if nibbles.shape[2] != 16 or k % group or s.shape != (n, k // group) or z.shape != s.shape:
            raise ValueError(f"int4: bad shapes nibbles {nibbles.shape}, s {s.shape}, z {z.shape}, group {group}")
        can = group == packing.GROUP and act == torch.bfloat16 and n % packing.TILE_ROWS == 0
        if use_native is None:
            use_native = can and native.available()
        if use_native:
            if not can:
                raise ValueError(f"the native int4 kernel takes groups of 32, bfloat16 and rows in 16s "
                                 f"(group {group}, {act}, {n} rows)")
            return cls(k, n, group, bias, act, tiles=packing.pack_tiles(nibbles, s, z))
        # torch's form: w = (q - 8) * scale + zero, as K/group x N x 2 (built in numpy: 4x torch's stack)
        stacked = np.empty((k // group, n, 2), dtype=np.float32)
        stacked[..., 0] = s.T
        stacked[..., 1] = (z + 8.0 * s).T
        return cls(k, n, group, bias, act, packed=int4pack.pack_nibbles(nibbles),
                   scales_zeros=torch.from_numpy(stacked).to(act))

    @classmethod
    def from_float(cls, w: torch.Tensor, group: int, bias: torch.Tensor | None = None,
                   act: torch.dtype = torch.bfloat16, use_native: bool | None = None) -> Int4Linear:
        """Min/max asymmetric quantization per group (what GGUF Q4_1 does)."""
        n, k = w.shape
        wg = w.float().reshape(n, k // group, group)
        lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, -1, 2, 16)
        nibbles = (q[:, :, 0] | (q[:, :, 1] << 4)).numpy()
        return cls.from_fields(nibbles, scale.numpy(), lo.numpy(), group, bias, act, use_native)

    @classmethod
    def from_gguf_blocks(cls, blocks: np.ndarray, kind: str, bias: torch.Tensor | None = None,
                         act: torch.dtype = torch.bfloat16, use_native: bool | None = None) -> Int4Linear:
        """``blocks``: a GGUF Q4_0, Q4_1 or Q4_K tensor's raw bytes, ``N x row bytes`` uint8. The nibbles are
        rearranged as bytes (Q4_K's into Q4_0's order), never widened; Q4_K's ``s = d sc``, ``z = -dmin m``."""
        return cls.from_fields(*gguf_quants.int4_fields(kind, blocks), 32, bias, act, use_native)

    @classmethod
    def from_tiles(cls, tiles: torch.Tensor, bias: torch.Tensor | None) -> Int4Linear:
        """On tickloom's kernel (bfloat16 activations), from ``packing.pack_tiles``' tiles (``gguf_pack.pack_gguf``
        packs a GGUF file's blocks so)."""
        return cls(32 * tiles.shape[1], 16 * tiles.shape[0], 32, bias, torch.bfloat16, tiles=tiles)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``N x K`` weight this layer multiplies by."""
        if self.tiles is not None:
            nibbles, s, z = packing.unpack_tiles(self.tiles)
            q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.float32)  # N x G x 32
            return torch.from_numpy((q * s[..., None] + z[..., None]).reshape(self.out_features, -1))
        assert self.packed is not None and self.scales_zeros is not None
        eye = torch.eye(self.in_features, dtype=self.act)  # unpacked by multiplying the identity
        return _INT4_MM(eye, self.packed, self.group, self.scales_zeros).float().t().contiguous()

    def _takes_as_is(self, x: torch.Tensor) -> bool:
        """The forward's case: a contiguous 2-D ``x`` in the activation dtype and no bias (no reshapes, no casts)."""
        return x.dim() == 2 and x.dtype == self.act and self.bias is None and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes_as_is(x):
            return self._mm(x)
        x2, lead = _matmul_2d(x, self.act, self.in_features)
        y = self._mm(x2.contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features).to(x.dtype)

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)``, float32: on tickloom's kernel the sums unrounded (for a float32 residual stream), else the
        layer's output widened."""
        if self.tiles is not None and self._takes_as_is(x):
            return native.matmul(x, self.tiles, self.out_features, torch.float32, passes=self.passes)
        return self(x).float()

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:
            return native.matmul(x, self.tiles, self.out_features, passes=self.passes)
        assert self.packed is not None and self.scales_zeros is not None
        return _INT4_MM(x, self.packed, self.group, self.scales_zeros)

    def nbytes(self) -> int:
        return _nbytes(self.tiles, self.packed, self.scales_zeros, self.bias)


def gguf_q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d ``N x G`` float32, q ``N x G x 32`` int8) of Q8_0 rows (34-byte blocks: fp16 d, 32 int8)."""
    n = blocks.shape[0]
    b = np.ascontiguousarray(blocks).reshape(n, -1, 34)
    return b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32), b[..., 2:].copy().view(np.int8)


class RawBlocks:
    """A GGUF tensor kept as the file stores it (any ``gguf_quants.BLOCKS`` type but F32): ``data`` is
    ``N x row bytes`` uint8, often a view of the file's mapping."""

    __slots__ = ("data", "kind", "shape")

    def __init__(self, kind: str, data: np.ndarray, shape: tuple[int, int]) -> None:
        if kind not in gguf_quants.BLOCKS or kind == "F32":
            raise ValueError(f"no block form for {kind}")
        self.kind, self.data, self.shape = kind, data, shape

    def dequantize(self) -> torch.Tensor:
        """float32 ``N x K`` (ggml's reference values: ``gguf_quants.dequantize``)."""
        return torch.from_numpy(gguf_quants.dequantize(self.kind, self.data))

    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @staticmethod
    def concat(parts: list[RawBlocks]) -> RawBlocks | None:
        """The row-wise concatenation of blocks of one kind and width, else None."""
        kinds = {p.kind for p in parts}
        widths = {p.shape[1] for p in parts}
        if len(kinds) != 1 or len(widths) != 1:
            return None
        rows = sum(p.shape[0] for p in parts)
        return RawBlocks(parts[0].kind, np.concatenate([p.data for p in parts]), (rows, parts[0].shape[1]))


Weight = torch.Tensor | RawBlocks


def _block_form(kind: str, quant: str, rows: int, act: torch.dtype) -> str:
    """How a GGUF tensor of ``kind`` becomes a layer under ``quant`` (not "none"): "int4" (``Int4Linear``, the
    file's 4-bit integers as they are), "int5" / "int6" (``WideIntLinear``, the 5- and 6-bit ones, where the
    kernels run and the activations are bfloat16; two names, as the two do not join into one layer), "grouped"
    (``GroupedInt8Linear``, as they are), "rows" (``Int8Linear``, one scale per row: Q8_0 under int8, as before),
    or "float" (dequantized, then quantized as a float weight)."""
    bits = QUANT_SETTINGS[quant][0]
    if kind in gguf_quants.INT4_KINDS and bits == 4 and rows % 16 == 0:
        return "int4"
    if (kind in gguf_quants.WIDE_KINDS and bits == 4 and rows % 16 == 0 and act == torch.bfloat16
            and native.available()):
        return "int6" if kind == "Q6_K" else "int5"
    if kind == "Q8_0" and bits == 8:
        return "rows"
    if kind in gguf_quants.FLOAT_KINDS or (bits == 8 and kind in ("Q4_0", "Q4_1")):
        return "float"
    return "grouped"


def _blocks_linear(run: list[RawBlocks], form: str, bias: torch.Tensor | None, quant: str,
                   act: torch.dtype) -> Linear:
    """One layer of consecutive GGUF tensors that share a ``_block_form``, stacked along the output axis. The
    file's pages it read leave the resident set once it is built (``drop_file_pages``), so that a load holds the
    layers made so far and one layer's file bytes, not the whole file beside them (1B Q8_0: 2.8 GB at its peak)."""
    layer = _blocks_layer(run, form, bias, quant, act)
    for w in run:
        drop_file_pages(w.data, whole=False)
    return layer


def _blocks_layer(run: list[RawBlocks], form: str, bias: torch.Tensor | None, quant: str,
                  act: torch.dtype) -> Linear:
    if form in ("int5", "int6"):
        return WideIntLinear.from_gguf([(w.kind, w.data) for w in run], bias, act)
    if _packs_in_c(form, run, act):  # the file's blocks straight into the kernels' tiles
        tiles = gguf_pack.pack_gguf([(w.kind, w.data) for w in run])
        if form == "int4":
            return Int4Linear.from_tiles(tiles, bias)
        return GroupedInt8Linear.from_q8_tiles(tiles, bias, act)
    if form == "int4":
        fields = [gguf_quants.int4_fields(w.kind, w.data) for w in run]
        nibbles, s, z = (np.concatenate([f[i] for f in fields]) for i in range(3))
        return Int4Linear.from_fields(nibbles, s, z, 32, bias, act)
    if form == "grouped":
        parts = [gguf_quants.int8_fields(w.kind, w.data) for w in run]
        group = min(p[3] for p in parts)  # 32-groups split into 16s where a Q6_K part has them: the same weights
        q = np.concatenate([p[0] for p in parts])
        scales = np.concatenate([np.repeat(p[1], p[3] // group, axis=1) for p in parts])
        zeros = None
        if any(p[2] is not None for p in parts):
            zeros = np.concatenate([np.repeat(np.zeros_like(p[1]) if p[2] is None else p[2], p[3] // group, axis=1)
                                    for p in parts])
        return GroupedInt8Linear.from_fields(q, scales, zeros, group, bias, act)
    joined = RawBlocks.concat(run) if len(run) > 1 else run[0]
    if form == "rows" and joined is not None:
        return Int8Linear.from_q8_0(joined.data, bias, act)
    return quantize_linear(torch.cat([w.dequantize() for w in run]), bias, quant, act)


def _packs_in_c(form: str, run: list[RawBlocks], act: torch.dtype) -> bool:
    """Whether ``run`` becomes its layer's tiles by ``gguf_pack`` (in C, part by part): as int4 on the kernel
    (bfloat16), 5 or 6 bits (``WideIntLinear.from_gguf`` packs them), or grouped Q8_0."""
    takes = {"int4": act == torch.bfloat16, "int5": True, "int6": True,
             "grouped": all(w.kind == "Q8_0" for w in run)}
    return takes.get(form, False) and gguf_pack.packs([(w.kind, w.data) for w in run])


def quantize_linear(w: Weight, bias: torch.Tensor | None, quant: str, act: torch.dtype) -> Linear:
    """A linear layer for weight ``w`` under ``quant`` (a ``QUANT_SETTINGS`` key). A GGUF tensor under a setting
    keeps the file's integers where a layer takes them (``_block_form``: Q4_0/Q4_1/Q4_K as int4 under "int4";
    Q5_0/Q5_1/Q5_K/Q6_K as 5- and 6-bit layers on the kernels, else, and Q8_0, as grouped int8; no float detour, no
    second rounding); F16 and
    BF16 under "none" in a float32 model stay 16-bit where the kernels run (``HalfLinear``), as does every weight
    of a bfloat16 model under "none" there (its matmuls then row-invariant); anything else is
    dequantized and quantized. Int4 falls back to int8 where the group does not divide the input size or the output
    size is not a multiple of 16. ``act`` is the activation dtype (and, with ``"none"``, the weight dtype)."""
    bits, group = QUANT_SETTINGS[quant]
    if isinstance(w, RawBlocks):
        if bits:
            return _blocks_linear([w], _block_form(w.kind, quant, w.shape[0], act), bias, quant, act)
        takes = act == torch.float32 or (act == torch.bfloat16 and w.kind == "BF16")
        if w.kind in packing.HALF_KINDS and takes and native.available() and w.shape[1] % 16 == 0:
            half = HalfLinear(w.kind, w.data.view(np.uint16), bias)  # the file's 16 bits, not a float32 copy
            drop_file_pages(w.data, whole=False)  # as _blocks_linear does: tiles are a copy
            return half
        w = w.dequantize()
    if not bits and act == torch.bfloat16 and w.device.type == "cpu" and native.available() and w.shape[1] % 16 == 0:
        # A bfloat16 model's projections on the kernels rather than torch's bfloat16 matmul, whose sums for a row
        # depend on how many rows share the call (one row and five differ in the last bits, enough to change a
        # token at a near-tie): the kernel's do not, so batching and speculation cannot change a token. Its
        # float32 sums are rounded to bfloat16 once, as torch's are.
        return HalfLinear("BF16", w.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16), bias)
    if bits == 4 and w.shape[0] % 16 == 0 and w.shape[1] % group == 0:  # the int4 pack wants rows in sixteens
        return Int4Linear.from_float(w, group, bias, act)
    if bits:
        return Int8Linear.from_float(w, bias, act)
    return DenseLinear(w.to(act), None if bias is None else bias.to(act))


def join_linear(ws: list[Weight], biases: list[torch.Tensor] | None, quant: str, act: torch.dtype) -> Linear:
    """One linear layer for several weights stacked along the output axis (fused q/k/v). GGUF tensors of
    different types join where their forms do (Q4_0 with Q4_K as int4, Q5_K with Q6_K as grouped int8); parts of
    different forms become a ``SplitLinear``."""
    bias = None if biases is None else torch.cat(biases)
    if len(ws) == 1:
        return quantize_linear(ws[0], bias, quant, act)
    blocks = [w for w in ws if isinstance(w, RawBlocks)]
    if len(blocks) == len(ws):
        if quant != "none" and len({(w.kind, w.shape[1]) for w in blocks}) == 1:
            form = _block_form(blocks[0].kind, quant, sum(w.shape[0] for w in blocks), act)
            if _packs_in_c(form, blocks, act):
                return _blocks_linear(blocks, form, bias, quant, act)  # the joined layer, without a copy of the bytes
        joined = RawBlocks.concat(blocks)
        if joined is not None:
            return quantize_linear(joined, bias, quant, act)
        if quant != "none":
            forms = [_block_form(w.kind, quant, w.shape[0], act) for w in blocks]
            runs: list[tuple[str, list[RawBlocks]]] = []
            for form, w in zip(forms, blocks, strict=True):
                if runs and runs[-1][0] == form:
                    runs[-1][1].append(w)
                else:
                    runs.append((form, [w]))
            if len(runs) == 1:
                return _blocks_linear(runs[0][1], runs[0][0], bias, quant, act)
            return SplitLinear([_blocks_linear(run, form, None, quant, act) for form, run in runs], bias)
    floats = [w.dequantize() if isinstance(w, RawBlocks) else w for w in ws]
    dense = torch.cat([f.to(act) if quant == "none" else f.float() for f in floats])
    return quantize_linear(dense, bias, quant, act)


def check_quant(quant: str, dtype: torch.dtype, device: torch.device) -> None:
    if quant not in QUANT_SETTINGS:
        raise ValueError(f"unknown quant {quant!r}; choose one of {sorted(QUANT_SETTINGS)}")
    if quant != "none" and device.type != "cpu":
        raise ValueError(f"quant {quant!r} runs on CPU only (device {device})")
    if quant != "none" and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quant {quant!r} needs a float32, bfloat16 or float16 model, not {dtype}")


def activation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype quantized matmuls take: the model's if it is 16-bit, else bfloat16."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def bf16_runs_fast() -> bool:
    """Whether a bfloat16 model with quantized matmuls runs fast on this CPU: tickloom's kernels run here (AVX2 at
    least: ``native.py``), which do a layer's work outside torch, or the CPU has native bfloat16 arithmetic
    (AVX512-BF16 or AMX), so torch's bf16 matmuls are fast."""
    return native.available() or bf16_supported()


def bf16_supported() -> bool:
    """Whether this CPU has native bfloat16 arithmetic (AVX512-BF16 or AMX), so bf16 matmuls are fast."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in ("AVX512", "AMX"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            flags = fh.read(1 << 16)
    except OSError:
        return cap == "AMX"
    return "avx512_bf16" in flags or "amx_bf16" in flags
