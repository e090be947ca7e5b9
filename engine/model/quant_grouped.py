"""Layers for GGUF tensors that no one packed int4 or per-row int8 form holds exactly: ``WideIntLinear`` (Q5_0,
Q5_1, Q5_K and Q6_K's five and six bits, on tickloom's kernels), ``GroupedInt8Linear`` (a scale per group of 16
or 32: GGUF's 5-, 6- and 8-bit types as the file has them, where no narrower form runs), ``HalfLinear`` (F16 and
BF16 values as the file has them, for a float32 model) and ``SplitLinear`` (a fused projection whose parts have
different forms). ``quant.quantize_linear`` and ``quant.join_linear`` choose them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from tickloom.engine.model import gguf_pack, gguf_quants, native, packing


class Layer(Protocol):
    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def nbytes(self) -> int: ...


def _nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


class GroupedInt8Linear:
    """Weight-only int8 with a scale, and for some types an offset, per group of 16 or 32 inputs:
    ``w[n, k] = s[n, g] * q[n, k] (+ z[n, g])``, ``g = k // group``. GGUF's 5-, 6- and 8-bit types (and 4-bit ones
    beside them in a fused projection) as the file has them: their integers fit int8 with the block's own scale, so
    nothing is rounded again (``gguf_quants.int8_fields``). ``Int8Linear``'s one scale per row could not hold them.

    Two ways to multiply: tickloom's 8-bit kernel (``native.q8_matmul``, the ``head.Q8Linear`` form) where it runs
    and the groups are 32 (``s`` rounded to float16; the offset added as the activations' group sums times ``z``);
    else float32 in torch, exact: up to ``_BMM_ROWS`` rows, one batched matmul of each group's activations by its
    integers and a sum weighted by the scales; more rows, the weight dequantized ``_SLICE_ELEMENTS`` at a time.
    Both read the integers as ``K/group x group x N`` (``q``), the scales and offsets as ``K/group x N``."""

    __slots__ = ("act", "bias", "group", "in_features", "out_features", "q", "s", "tiles", "z")

    def __init__(self, in_features: int, out_features: int, group: int, bias: torch.Tensor | None, act: torch.dtype,
                 *, tiles: torch.Tensor | None = None, q: torch.Tensor | None = None, s: torch.Tensor | None = None,
                 z: torch.Tensor | None = None) -> None:
        """The layer from its weight as one path takes it: the 8-bit kernel's ``tiles`` (``packing.pack_q8_tiles``',
        which hold the scales), or torch's ``q`` and ``s``; ``z`` (``K/group x N`` float32) either way, or None.
        ``from_fields`` and the other constructors make them."""
        if (tiles is not None) == (q is not None) or (q is None) != (s is None):
            raise ValueError("grouped int8: give the kernel's tiles, or torch's integers and scales, not both")
        self.in_features, self.out_features, self.group, self.act = in_features, out_features, group, act
        self.bias = None if bias is None else bias.to(act)
        self.tiles, self.q, self.s, self.z = tiles, q, s, z

    @classmethod
    def from_fields(cls, q: np.ndarray, s: np.ndarray, z: np.ndarray | None, group: int, bias: torch.Tensor | None,
                    act: torch.dtype, use_native: bool | None = None) -> GroupedInt8Linear:
        """``q``: ``N x K`` int8; ``s``, ``z`` (or None): ``N x K/group`` float32. Packed for the 8-bit kernel where
        it runs (``use_native`` None) and the groups are 32, else kept for torch."""
        n, k = q.shape
        if k % group or s.shape != (n, k // group) or (z is not None and z.shape != s.shape):
            raise ValueError(f"grouped int8: bad shapes q {q.shape}, s {s.shape}, group {group}")
        can = group == packing.GROUP and n % packing.TILE_ROWS == 0
        if use_native is None:
            use_native = can and native.available()
        if use_native and not can:
            raise ValueError(f"the native 8-bit kernel takes groups of 32 and rows in 16s (group {group}, {n} rows)")
        zt = None if z is None else torch.from_numpy(np.ascontiguousarray(z.T, dtype=np.float32))
        if use_native:
            # the kernel's tiles hold the scales (as float16): a float32 copy beside them would be 12% of a Q8_0
            # layer's memory, read by nothing
            return cls(k, n, group, bias, act, tiles=packing.pack_q8_tiles(np.ascontiguousarray(q), s), z=zt)
        qt = torch.from_numpy(np.ascontiguousarray(q.reshape(n, k // group, group).transpose(1, 2, 0)))
        return cls(k, n, group, bias, act, q=qt, s=torch.from_numpy(np.ascontiguousarray(s.T, dtype=np.float32)),
                   z=zt)

    @classmethod
    def from_gguf_blocks(cls, blocks: np.ndarray, kind: str, bias: torch.Tensor | None = None,
                         act: torch.dtype = torch.bfloat16, use_native: bool | None = None) -> GroupedInt8Linear:
        if kind == "Q8_0" and use_native is not False and gguf_pack.packs([(kind, blocks)]):
            return cls.from_q8_tiles(gguf_pack.pack_gguf([(kind, blocks)]), bias, act)
        q, s, z, group = gguf_quants.int8_fields(kind, blocks)
        return cls.from_fields(q, s, z, group, bias, act, False if group != packing.GROUP else use_native)

    @classmethod
    def from_q8_tiles(cls, tiles: torch.Tensor, bias: torch.Tensor | None = None,
                      act: torch.dtype = torch.bfloat16) -> GroupedInt8Linear:
        """On the 8-bit kernel with no offset (GGUF Q8_0's), from ``packing.pack_q8_tiles``' tiles
        (``gguf_pack.pack_gguf`` packs a file's Q8_0 blocks so)."""
        return cls(packing.GROUP * tiles.shape[1], packing.TILE_ROWS * tiles.shape[0], packing.GROUP, bias, act,
                   tiles=tiles)

    def _columns(self, lo: int, hi: int) -> torch.Tensor:
        """Output rows ``lo:hi`` of the float32 weight as ``K x (hi - lo)``, computed as
        ``gguf_quants.dequantize`` computes them (``s * q + z``)."""
        if self.q is None:
            assert self.tiles is not None
            s16 = torch.from_numpy(packing.q8_tile_scales(self.tiles.numpy())[lo:hi].T).repeat_interleave(self.group,
                                                                                                          dim=0)
            q = packing.q8_tile_integers(self.tiles.numpy()).reshape(self.out_features, -1)[lo:hi]
            w = torch.from_numpy(q.astype(np.float32)).t() * s16
            return w if self.z is None else w + self.z[:, lo:hi].repeat_interleave(self.group, dim=0)
        assert self.s is not None
        w = self.s[:, None, lo:hi] * self.q[:, :, lo:hi].float()
        if self.z is not None:
            w += self.z[:, None, lo:hi]
        return w.view(self.in_features, hi - lo)

    def dequantize(self) -> torch.Tensor:
        return self._columns(0, self.out_features).t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = tuple(x.shape[:-1])
        y = self._mm(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features).to(x.dtype)

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` for a 2-D ``x``, float32 and unrounded (for a float32 residual stream)."""
        y = self._mm_float(x)
        return y if self.bias is None else y + self.bias.float()

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm_float(x).to(self.act)

    def _mm_float(self, x: torch.Tensor) -> torch.Tensor:
        m, g = x.shape[0], self.in_features // self.group
        if self.tiles is not None:
            y = native.q8_matmul(x.to(torch.bfloat16).contiguous(), self.tiles, self.out_features)
            if self.z is not None:
                y += x.float().view(m, g, self.group).sum(-1) @ self.z
            return y
        xf = x.float()
        if m <= _BMM_ROWS:
            assert self.q is not None and self.s is not None
            parts = torch.bmm(xf.view(m, g, self.group).transpose(0, 1), self.q.float())  # G x M x N
            y = (parts * self.s[:, None, :]).sum(0)
        else:
            step = max(16, _SLICE_ELEMENTS // self.in_features)
            y = torch.empty(m, self.out_features)
            for lo in range(0, self.out_features, step):
                hi = min(lo + step, self.out_features)
                y[:, lo:hi] = xf @ self._columns(lo, hi)  # the offsets are in the weight here
            return y
        if self.z is not None:
            y += xf.view(m, g, self.group).sum(-1) @ self.z
        return y

    def nbytes(self) -> int:
        return _nbytes(self.q, self.tiles, self.s, self.z, self.bias)


_BMM_ROWS = 8
"""Up to this many rows, ``GroupedInt8Linear`` multiplies group by group (3x the dequantizing path at one row on
a 2816 x 1024 weight; 20x slower at 64 rows, where the dequantized weight's matmul wins)."""

_SLICE_ELEMENTS = 1 << 21
"""``GroupedInt8Linear``'s float32 temporary when it dequantizes: 8 MB at most."""


class WideIntLinear:
    """GGUF's 5- and 6-bit types as the file has them, on tickloom's kernels (``native.matmul(bits=...)``):
    ``w = s * q + z`` with ``q`` in 0..31 per group of 32 (Q5_0: ``z = -16 s``; Q5_1: ``s = d, z = m``; Q5_K:
    ``s = d sc, z = -dmin m``), ``s`` and ``z`` kept as float16 (exact for Q5_0 and Q5_1, whose d and m are
    float16; Q5_K's products are rounded once, as Q4_K's are in ``Int4Linear``), 0.75 bytes a weight; or ``w = d sc
    (q - 32)`` with ``q`` in 0..63 and an int8 ``sc`` per 16 (Q6_K, its numbers as the file has them, 0.82 bytes a
    weight: ``packing.pack_q6_tiles``). The grouped int8 form these types took before was 1.125 bytes a weight
    (torch's float32 path for Q6_K's groups of 16), and at batch 1 the bytes are the time a step takes. Elsewhere
    ``GroupedInt8Linear`` holds the same values."""

    __slots__ = ("act", "bias", "bits", "in_features", "out_features", "passes", "tiles")

    def __init__(self, tiles: torch.Tensor, shape: tuple[int, int], bits: int, bias: torch.Tensor | None,
                 act: torch.dtype) -> None:
        """``tiles``: ``packing.pack_wide_tiles``' (5 bits) or ``pack_q6_tiles``' (6) of an ``N x K`` weight."""
        n, k = shape
        if n % packing.TILE_ROWS or k % (256 if bits == 6 else packing.GROUP) or bits not in (5, 6):
            raise ValueError(f"int{bits}: {shape} must have rows in 16s and groups of 32 (256 for 6 bits)")
        if act != torch.bfloat16:
            raise ValueError(f"the {bits}-bit kernel takes bfloat16 activations, not {act}")
        self.out_features, self.in_features, self.bits, self.act = n, k, bits, act
        self.bias = None if bias is None else bias.to(act)
        self.tiles = tiles
        self.passes = 1  # as Int4Linear's

    @classmethod
    def five(cls, q: np.ndarray, s: np.ndarray, z: np.ndarray, bias: torch.Tensor | None, act: torch.dtype
             ) -> WideIntLinear:
        """``q``: ``N x K`` in 0..31, ``s``, ``z`` ``N x K/32``."""
        return cls(packing.pack_wide_tiles(q, s, z, 5), q.shape, 5, bias, act)

    @classmethod
    def six(cls, q: np.ndarray, sc: np.ndarray, d: np.ndarray, bias: torch.Tensor | None, act: torch.dtype
            ) -> WideIntLinear:
        """``q``: ``N x K`` in 0..63, ``sc`` ``N x K/16`` int8, ``d`` ``N x K/256``: Q6_K's numbers."""
        return cls(packing.pack_q6_tiles(q, sc, d), q.shape, 6, bias, act)

    @classmethod
    def from_gguf(cls, parts: list[tuple[str, np.ndarray]], bias: torch.Tensor | None, act: torch.dtype
                  ) -> WideIntLinear:
        """GGUF tensors ``(kind, raw bytes N x row bytes)``, all 5-bit types or all Q6_K, stacked along the output
        axis."""
        six = parts[0][0] == "Q6_K"
        for kind, _ in parts:
            if (kind == "Q6_K") != six or kind not in gguf_quants.WIDE_KINDS:
                raise ValueError(f"{kind} does not join {parts[0][0]} in a 5- or 6-bit layer")
        if gguf_pack.packs(parts):  # the file's blocks straight into the tiles, in C
            tiles = gguf_pack.pack_gguf(parts)
            unit = 256 if six else packing.GROUP  # Q6_K's tiles come in super-blocks of 256 inputs
            return cls(tiles, (packing.TILE_ROWS * tiles.shape[0], unit * tiles.shape[1]), 6 if six else 5, bias, act)
        if six:
            fields = [gguf_quants.q6_fields(data) for _, data in parts]
            q, sc, d = (np.concatenate([f[i] for f in fields]) for i in range(3))
            return cls.six(q, sc, d, bias, act)
        qs: list[np.ndarray] = []
        ss: list[np.ndarray] = []
        zs: list[np.ndarray] = []
        for kind, data in parts:
            q, s, z, _ = gguf_quants.int8_fields(kind, data)
            if z is None:  # Q5_0 stores q - 16
                q, z = q.astype(np.int16) + 16, -16.0 * s
            qs.append(q.astype(np.uint8))
            ss.append(s)
            zs.append(z)
        return cls.five(np.concatenate(qs), np.concatenate(ss), np.concatenate(zs), bias, act)

    def _mm(self, x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(self.act).contiguous()
        y = native.matmul(x2, self.tiles, self.out_features, out, bits=self.bits, passes=self.passes)
        if self.bias is not None:
            y = y + self.bias.to(out)
        return y.view(*x.shape[:-1], self.out_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._mm(x, torch.bfloat16).to(x.dtype)

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """The same sums unrounded (for the float32 residual stream)."""
        return self._mm(x, torch.float32)

    def dequantize(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        if self.bits == 6:
            q6, sc, d = packing.unpack_q6_tiles(self.tiles)
            s = d.reshape(n, -1, 1) * sc.reshape(n, -1, 16).astype(np.float32)  # per 16, as the file's
            w = (q6.reshape(n, -1, 16).astype(np.float32) - 32.0) * s.reshape(n, -1, 1)
            return torch.from_numpy(w.reshape(n, k))
        q, s, z = packing.unpack_wide_tiles(self.tiles, self.bits)
        w = q.reshape(n, -1, packing.GROUP).astype(np.float32) * s[..., None] + z[..., None]
        return torch.from_numpy(w.reshape(n, k))

    def nbytes(self) -> int:
        return _nbytes(self.tiles, self.bias)


class HalfLinear:
    """A GGUF F16 or BF16 matrix for a float32 model (or any weight of a bfloat16 model, in bfloat16), as the file
    stores it: its 16-bit values, reordered once into
    the kernel's 4-row tiles (``packing.pack_half_tiles``: one stream per step, where the file's rows side by side
    were four; the same bytes as the file, and the file's pages are dropped after the load). ``native.half_matmul``
    widens each weight to float32 as it multiplies, so the products are the float32 model's, at half its memory and
    half its bytes read per token. Built only where tickloom's kernels run (``quant.quantize_linear``)."""

    __slots__ = ("bias", "in_features", "kind", "out_features", "tiles")

    def __init__(self, kind: str, w: np.ndarray, bias: torch.Tensor | None) -> None:
        if kind not in packing.HALF_KINDS or w.dtype != np.uint16 or w.ndim != 2 or w.shape[1] % 16:
            raise ValueError(f"HalfLinear takes F16 or BF16 bits N x K, K a multiple of 16 (got {kind}, {w.dtype}, "
                             f"{w.shape})")
        self.kind, self.tiles = kind, packing.pack_half_tiles(w)
        self.out_features, self.in_features = w.shape
        self.bias = None if bias is None else bias.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_f32(x).to(x.dtype)

    def forward_f32(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` before its rounding to ``x``'s dtype (for a float32 residual stream)."""
        if x.dtype == torch.bfloat16 and self.kind == "BF16":  # a bfloat16 model: pair products on bfloat16
            y = native.bf16_matmul(x.reshape(-1, self.in_features).contiguous(), self.tiles, self.out_features)
        else:
            y = native.half_matmul(x.reshape(-1, self.in_features).float().contiguous(), self.tiles,
                                   self.out_features, self.kind)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        bits = packing.unpack_half_tiles(self.tiles, self.out_features)
        return torch.from_numpy(gguf_quants.dequantize(self.kind, np.ascontiguousarray(bits).view(np.uint8)))

    def nbytes(self) -> int:
        return int(self.tiles.nbytes) + _nbytes(self.bias)


class SplitLinear:
    """Linear layers side by side along the output axis: a fused projection (q/k/v, gate/up) whose parts the file
    stores in forms no one kernel takes (Q4_K_M files keep some ``attn_v`` in Q6_K beside Q4_K ``attn_q``)."""

    __slots__ = ("bias", "in_features", "out_features", "parts")

    def __init__(self, parts: list[Layer], bias: torch.Tensor | None) -> None:
        self.parts, self.bias = parts, bias
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``N x K`` weight: the parts' stacked."""
        weights = []
        for p in self.parts:
            dequantize = getattr(p, "dequantize", None)
            if dequantize is None:
                raise TypeError(f"SplitLinear.dequantize: its {type(p).__name__} part cannot give its weight back")
            weights.append(dequantize().float())
        return torch.cat(weights)

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts) + _nbytes(self.bias)
