"""GGUF's block formats, decoded with numpy: each quantized type's raw bytes as the integers and scales it stores.

A leaf (numpy only). The layouts are ggml's block structs (``ggml-common.h``, as the GGUF spec documents them);
every quantized type here is, per group of 16 or 32 weights, ``w = s * q + z`` with an integer ``q``:

============  ======  ========  =========================================================================
type          bytes   weights   block
============  ======  ========  =========================================================================
Q4_0          18      32        f16 d; 16 bytes of nibbles. ``w = d (q - 8)``
Q4_1          20      32        f16 d, f16 m; 16 bytes of nibbles. ``w = d q + m``
Q5_0          22      32        f16 d; u32 high bits; 16 bytes of nibbles. ``w = d (q - 16)``
Q5_1          24      32        f16 d, f16 m; u32 high bits; nibbles. ``w = d q + m``
Q8_0          34      32        f16 d; 32 int8. ``w = d q``
Q4_K          144     256       f16 d, f16 dmin; 12 bytes of 6-bit scales and mins (8 each); 128 bytes of
                                nibbles. Per 32: ``w = (d sc) q - (dmin m)``
Q5_K          176     256       as Q4_K, plus 32 bytes of high bits (bit ``j`` of byte ``l``: sub-block
                                ``j``, element ``l``)
Q6_K          210     256       128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d. Per 16:
                                ``w = (d sc) (q - 32)``
F16, BF16     2       1         16-bit floats
============  ======  ========  =========================================================================

In a block of 32 (and in each 32 of a K-quant's 256), byte ``j`` of the nibbles holds element ``j`` low and
``j + 16`` high; a K-quant's 128 nibble bytes are four runs of 32, run ``c`` holding sub-block ``2c`` in its low
nibbles and ``2c + 1`` in its high ones. ``dequantize`` does each type's arithmetic in float32 in the order ggml's
reference does, so it gives the same floats.
"""

from __future__ import annotations

import numpy as np

BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (4, 1), "F16": (2, 1), "BF16": (2, 1),
    "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32), "Q8_0": (34, 32),
    "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256),
}
"""Type -> (bytes per block, weights per block), for the types tickloom reads as they are."""

GGML_TYPES: dict[int, str] = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
                              12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}
"""GGML tensor type id -> name, for the types in ``BLOCKS``."""

GGML_TYPE_NAMES: dict[int, str] = {
    **GGML_TYPES, 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64",
    28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
"""Every GGML type id's name, for messages."""

INT4_KINDS = ("Q4_0", "Q4_1", "Q4_K")
"""The types whose weights are 4-bit integers in groups of 32 (``int4_fields``)."""
INT5_KINDS = ("Q5_0", "Q5_1", "Q5_K")
WIDE_KINDS = (*INT5_KINDS, "Q6_K")
"""The 5- and 6-bit types (``quant_grouped.WideIntLinear``)."""
INT_KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
"""The integer types (``int8_fields``)."""
FLOAT_KINDS = ("F32", "F16", "BF16")


def row_bytes(kind: str, cols: int) -> int:
    size, per = BLOCKS[kind]
    if cols % per:
        raise ValueError(f"{kind} rows hold whole blocks of {per} weights, not {cols}")
    return cols // per * size


def _blocks(data: np.ndarray, kind: str) -> np.ndarray:
    """``N x row bytes`` -> ``N x blocks x block bytes`` (a view when ``data`` is contiguous)."""
    return np.ascontiguousarray(data).reshape(data.shape[0], -1, BLOCKS[kind][0])


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte ``at`` of every block, as float32."""
    return np.ascontiguousarray(b[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """``... x 16`` nibble bytes of blocks of 32 -> ``... x 32`` values 0..15 (low nibbles first)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """``... x 4`` bytes, a little-endian u32 per block of 32 -> ``... x 32`` bits (element ``i``: bit ``i``)."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _k_scales_mins(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> (8 scales, 8 mins), 6 bits each: sub-blocks 0-3 in the low 6 bits of bytes 0-3
    (scales) and 4-7 (mins); 4-7 in bytes 8-11's nibbles (scale low, min high) with their top 2 bits in the top 2
    bits of bytes 0-3 (scales) and 4-7 (mins)."""
    lo, hi, last = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = np.concatenate([lo & 0x3F, (last & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([hi & 0x3F, (last >> 4) | ((hi >> 6) << 4)], axis=-1)
    return scales, mins


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """A K-quant's ``... x 128`` nibble bytes -> ``... x 8 x 32`` values 0..15, sub-block by sub-block."""
    runs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def int8_fields(kind: str, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
    """An integer type's rows as ``(q, s, z, group)``: ``q`` ``N x K`` int8, ``s`` (and ``z``, or None when the
    type has no offset) ``N x K/group`` float32, with ``w = s * q (+ z)`` per group, computed as ggml's reference
    dequantizer computes it (``(d * sc) * q - dmin * m``: ``s = d * sc``, ``z = -(dmin * m)``)."""
    n = data.shape[0]
    b = _blocks(data, kind)
    z: np.ndarray | None = None
    if kind in ("Q4_0", "Q4_1"):
        q = _nibbles32(b[..., -16:]).astype(np.int8)
        s = _f16(b, 0)
        if kind == "Q4_0":
            q -= 8
        else:
            z = _f16(b, 2)
        group = 32
    elif kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4
        q = (_nibbles32(b[..., at + 4 :]) | (_high_bits32(b[..., at : at + 4]) << 4)).astype(np.int8)
        s = _f16(b, 0)
        if kind == "Q5_0":
            q -= 16
        else:
            z = _f16(b, 2)
        group = 32
    elif kind == "Q8_0":
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8)
        s, group = _f16(b, 0), 32
    elif kind in ("Q4_K", "Q5_K"):
        sc, m = _k_scales_mins(b[..., 4:16])
        qs_at = 16 if kind == "Q4_K" else 48
        q = _k_nibbles(b[..., qs_at : qs_at + 128])
        if kind == "Q5_K":  # bit j of high byte l is element l of sub-block j
            bits = np.unpackbits(np.ascontiguousarray(b[..., 16:48])[..., None], axis=-1, bitorder="little")
            q = q | (np.swapaxes(bits, -1, -2) << 4)
        q = q.astype(np.int8)
        s = _f16(b, 0)[..., None] * sc.astype(np.float32)
        z = -(_f16(b, 2)[..., None] * m.astype(np.float32))
        group = 32
    elif kind == "Q6_K":
        q6, sc, d = q6_fields(data)
        q = q6.astype(np.int8) - np.int8(32)
        s = d.reshape(n, -1, 1) * sc.reshape(n, -1, 16).astype(np.float32)
        group = 16
    else:
        raise ValueError(f"{kind} is not an integer GGUF type")
    q = q.reshape(n, -1)
    return q, s.reshape(n, -1), None if z is None else z.reshape(n, -1), group


def q6_fields(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K rows as the file has them: ``(q, sc, d)``, ``q`` ``N x K`` uint8 in 0..63, ``sc`` ``N x K/16`` int8,
    ``d`` ``N x K/256`` float32 (float16 values); ``w = d sc (q - 32)`` per 16."""
    n = data.shape[0]
    b = _blocks(data, "Q6_K")
    ql, qh = b[..., 0:128], b[..., 128:192]
    low = np.concatenate([ql[..., :64] & 0x0F, ql[..., :64] >> 4, ql[..., 64:] & 0x0F, ql[..., 64:] >> 4], -1)
    halves = qh.reshape(*qh.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    high = (halves & 0x03).reshape(*qh.shape[:-1], 256)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8)
    return (low | (high << 4)).reshape(n, -1), sc.reshape(n, -1), _f16(b, 208).reshape(n, -1)


def int4_fields(kind: str, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 4-bit type's rows as ``(nibbles, s, z)`` with ``w = s * q + z`` per 32, ``q`` in 0..15: ``nibbles``
    ``N x K/32 x 16`` uint8 in Q4_0's order (byte ``j``: element ``j`` low, ``j + 16`` high), ``s``, ``z``
    ``N x K/32`` float32. The nibbles are rearranged as bytes, never widened. Q4_0's ``z`` is ``-8 d``."""
    n = data.shape[0]
    b = _blocks(data, kind)
    if kind in ("Q4_0", "Q4_1"):
        size = BLOCKS[kind][0]
        d = _f16(b, 0)
        z = _f16(b, 2) if kind == "Q4_1" else -8.0 * d
        return b[..., size - 16 :], d, z
    if kind != "Q4_K":
        raise ValueError(f"{kind} is not a 4-bit GGUF type")
    runs = b[..., 16:144].reshape(n, -1, 4, 2, 16)  # super-block, run, half, byte
    first, second = runs[..., 0, :], runs[..., 1, :]  # elements j and 16 + j of both sub-blocks of a run
    even = (first & 0x0F) | (second << 4)  # the run's low nibbles: sub-block 2c
    odd = (first >> 4) | (second & 0xF0)  # its high nibbles: sub-block 2c + 1
    nibbles = np.stack([even, odd], axis=-2).reshape(n, -1, 16)
    sc, m = _k_scales_mins(b[..., 4:16])
    s = _f16(b, 0)[..., None] * sc.astype(np.float32)
    z = -(_f16(b, 2)[..., None] * m.astype(np.float32))
    return nibbles, s.reshape(n, -1), z.reshape(n, -1)


def dequantize(kind: str, data: np.ndarray) -> np.ndarray:
    """``N x row bytes`` of ``kind`` -> float32 ``N x K``."""
    n = data.shape[0]
    if kind == "F32":
        return np.ascontiguousarray(data).view(np.float32).reshape(n, -1)
    if kind == "F16":
        return np.ascontiguousarray(data).view(np.float16).astype(np.float32).reshape(n, -1)
    if kind == "BF16":
        half = np.ascontiguousarray(data).view(np.uint16).astype(np.uint32) << 16
        return half.view(np.float32).reshape(n, -1)
    q, s, z, group = int8_fields(kind, data)
    w = s[..., None] * q.reshape(n, -1, group).astype(np.float32)
    if z is not None:
        w += z[..., None]
    return w.reshape(n, -1)
