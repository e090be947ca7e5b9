"""How tickloom's CPU kernels lay out their weights (``cpu_kernels.c`` describes each layout): packing a GGUF
tensor's integers, scales and 16-bit values into the kernels' tiles once at load, and reading them back (for
``dequantize`` and the embedding's rows). Numpy only; the kernels themselves are ``native.py``'s."""

from __future__ import annotations

import numpy as np
import torch

TILE_ROWS = 16
TILE_BYTES = 320
WIDE_TILE_BYTES = {5: 384}
Q6_TILE_BYTES = 416
Q6_SUPER_BYTES = 32 + 8 * Q6_TILE_BYTES
"""A 6-bit row block's stream is super-blocks of 8 groups: the 16 rows' d, then 8 tiles (``pack_q6_tiles``)."""
Q8_TILE_BYTES = 576
GROUP = 32
HALF_KINDS = {"BF16": 0, "F16": 1}
"""The 16-bit weight types ``half_matmul`` reads, and the kernel's code for each."""
HALF_TILE_ROWS = 4


def pack_tiles(nibbles: np.ndarray, s: np.ndarray, z: np.ndarray) -> torch.Tensor:
    """The kernel's weight: ``nibbles`` ``N x G x 16`` bytes in GGUF Q4 order (byte ``j`` of group ``g`` holds
    inputs ``32 g + j`` low and ``32 g + 16 + j`` high), ``s`` and ``z`` ``N x G`` (``w = s * q + z``), rounded to
    float16 as GGUF stores them. ``N % 16 == 0``. Returns ``N / 16 x G x 320`` bytes (layout: ``cpu_kernels.c``)."""
    n, g, _ = nibbles.shape
    b = n // TILE_ROWS
    out = np.empty((b, g, TILE_BYTES), dtype=np.uint8)
    out[..., :256] = _tile_nibbles(nibbles)
    for at, v in ((256, s), (288, z)):
        half = np.ascontiguousarray(v.astype(np.float16).reshape(b, TILE_ROWS, g).transpose(0, 2, 1))
        out[..., at : at + 32] = half.view(np.uint8)
    return torch.from_numpy(out)


def tile_buffer(*shape: int) -> torch.Tensor:
    """An uninitialized uint8 buffer for a layer's tiles. Allocated by numpy, which asks Linux for transparent huge
    pages on large arrays (``madvise(MADV_HUGEPAGE)``; this host's THP setting is "madvise", so nothing else gets
    them) where ``torch.empty`` does not: a step streams every tile once, and on 4 KB pages the TLB misses cost the
    1B Q4_0 model's batch 1 about a quarter of its speed (21.8 tok/s against 27-30 on numpy's buffers)."""
    return torch.from_numpy(np.empty(shape, dtype=np.uint8))


def _tile_nibbles(nibbles: np.ndarray) -> np.ndarray:
    """``N x G x 16`` nibble bytes in GGUF Q4 order -> ``N/16 x G x 256``, the tiles' chunks (``pack_tiles``)."""
    n, g, _ = nibbles.shape
    b = n // TILE_ROWS
    return nibbles.reshape(b, TILE_ROWS, g, 4, 4).transpose(0, 2, 3, 1, 4).reshape(b, g, 256)


def _from_tile_nibbles(chunks: np.ndarray) -> np.ndarray:
    """``_tile_nibbles``' inverse: ``N x G x 16``."""
    b, g, _ = chunks.shape
    return chunks.reshape(b, g, 4, TILE_ROWS, 4).transpose(0, 3, 1, 2, 4).reshape(b * TILE_ROWS, g, 16)


def pack_wide_tiles(q: np.ndarray, s: np.ndarray, z: np.ndarray | None, bits: int) -> torch.Tensor:
    """The 5-bit kernel's weight: ``q`` ``N x K`` integers below 32, ``w = s * q + z`` per group of 32 (GGUF
    Q5_0/Q5_1/Q5_K; ``s``, ``z`` ``N x K/32``). ``pack_tiles``' tile for the low four bits and the scales, then
    per chunk the fifth bits (layout: ``cpu_kernels.c``). Returns ``N / 16 x K/32 x 384`` bytes. (6 bits:
    ``pack_q6_tiles``.)"""
    n, k = q.shape
    b, g = n // TILE_ROWS, k // GROUP
    if bits != 5 or s.shape != (n, g) or z is None or z.shape != s.shape:
        raise ValueError(f"wide tiles: bits {bits} (5; pack_q6_tiles for 6), q {q.shape}, s {s.shape}, "
                         f"z {None if z is None else z.shape}")
    qg = q.reshape(n, g, GROUP).astype(np.uint8)
    low = qg & 0x0F
    base = pack_tiles(low[..., :16] | (low[..., 16:] << 4), s, z).numpy()
    # per chunk, a 64-bit mask for each nibble
    extra = np.packbits(_high_bits(qg, b, g), axis=-1, bitorder="little").reshape(b, g, 64)
    return torch.from_numpy(np.concatenate([base, extra], axis=-1))


def _high_bits(qg: np.ndarray, b: int, g: int) -> np.ndarray:
    """``q >> 4`` of ``N x G x 32`` values in the tiles' order, ``b x g x 4 x 2 x 64``: element 16 h + 4 t + c of a
    group sits in chunk t, byte 4 r + c (r: the row in its block), nibble h."""
    return (qg >> 4).reshape(b, TILE_ROWS, g, 2, 4, 4).transpose(0, 2, 4, 3, 1, 5).reshape(b, g, 4, 2, 64)


def _from_high_bits(high: np.ndarray, b: int, g: int) -> np.ndarray:
    """``_high_bits``' inverse, shifted back: ``N x G x 32``."""
    return high.reshape(b, g, 4, 2, TILE_ROWS, 4).transpose(0, 4, 1, 3, 2, 5).reshape(b * TILE_ROWS, g, GROUP) << 4


def unpack_wide_tiles(tiles: torch.Tensor, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``pack_wide_tiles``' inverse: (q ``N x K`` uint8, s, z float32)."""
    if bits != 5:
        raise ValueError(f"wide tiles: bits {bits} (5; unpack_q6_tiles for 6)")
    t = tiles.numpy()
    b, g, _ = t.shape
    nibbles, s, z = unpack_tiles(torch.from_numpy(np.ascontiguousarray(t[..., :TILE_BYTES])))
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    q |= _from_high_bits(np.unpackbits(t[..., TILE_BYTES:].reshape(b, g, 4, 2, 8), axis=-1, bitorder="little"), b, g)
    return q.reshape(b * TILE_ROWS, g * GROUP), s, z


def pack_q6_tiles(q: np.ndarray, sc: np.ndarray, d: np.ndarray) -> torch.Tensor:
    """The 6-bit kernel's weight, GGUF Q6_K's numbers as the file has them: ``q`` ``N x K`` in 0..63, ``sc``
    ``N x K/16`` int8 and ``d`` ``N x K/256`` (float16 values), ``w = d sc (q - 32)``. ``N % 16 == 0``, ``K % 256 ==
    0``. Per row block, super-blocks of 8 groups: the 16 rows' d (float16), then 8 tiles of 416 bytes: the nibbles
    as ``pack_tiles`` has them, per chunk 32 bytes of the two high bits (byte i: those of byte i's low and high
    nibbles, then of byte 32 + i's), the 16 rows' ``sc`` of the group's first half, then of its second (layout:
    ``cpu_kernels.c``). Returns ``N / 16 x K/256 x 3360`` bytes, the file's 210 per 256 weights."""
    n, k = q.shape
    b, g, sb = n // TILE_ROWS, k // GROUP, k // 256
    if n % TILE_ROWS or k % 256 or sc.shape != (n, 2 * g) or d.shape != (n, sb):
        raise ValueError(f"q6 tiles: q {q.shape} (rows in 16s, K a multiple of 256), sc {sc.shape}, d {d.shape}")
    qg = q.reshape(n, g, GROUP).astype(np.uint8)
    low = qg & 0x0F
    high = _high_bits(qg, b, g)
    extra = (high[..., 0, :32] | high[..., 1, :32] << 2 | high[..., 0, 32:] << 4 | high[..., 1, 32:] << 6
             ).astype(np.uint8).reshape(b, g, 128)
    halves = sc.astype(np.int8).reshape(b, TILE_ROWS, g, 2).transpose(0, 2, 3, 1).reshape(b, g, 32).view(np.uint8)
    tiles = np.concatenate([_tile_nibbles(low[..., :16] | (low[..., 16:] << 4)), extra, halves], axis=-1)
    ds = np.ascontiguousarray(d.astype(np.float16).reshape(b, TILE_ROWS, sb).transpose(0, 2, 1)).view(np.uint8)
    return torch.from_numpy(np.concatenate([ds, tiles.reshape(b, sb, 8 * Q6_TILE_BYTES)], axis=-1))


def unpack_q6_tiles(tiles: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``pack_q6_tiles``' inverse: (q ``N x K`` uint8, sc ``N x K/16`` int8, d ``N x K/256`` float32)."""
    t = tiles.numpy()
    b, sb, _ = t.shape
    g = 8 * sb
    d = np.ascontiguousarray(t[..., :32]).view(np.float16).astype(np.float32).transpose(0, 2, 1)
    body = t[..., 32:].reshape(b, g, Q6_TILE_BYTES)
    nibbles = _from_tile_nibbles(body[..., :256])
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    packed = body[..., 256:384].reshape(b, g, 4, 32)
    high = np.stack([np.concatenate([packed & 3, packed >> 4 & 3], axis=-1),
                     np.concatenate([packed >> 2 & 3, packed >> 6], axis=-1)], axis=3)  # b, g, t, h, 64
    q |= _from_high_bits(high, b, g)
    sc = body[..., 384:].view(np.int8).reshape(b, g, 2, TILE_ROWS).transpose(0, 3, 1, 2)
    return (q.reshape(b * TILE_ROWS, g * GROUP), np.ascontiguousarray(sc).reshape(b * TILE_ROWS, 2 * g),
            np.ascontiguousarray(d).reshape(b * TILE_ROWS, sb))


def pack_q8_tiles(q: np.ndarray, d: np.ndarray) -> torch.Tensor:
    """The 8-bit kernel's weight: ``q`` ``N x K`` int8 and ``d`` ``N x K/32`` (``w = d * q`` per group of 32, GGUF
    Q8_0's form; ``d`` kept as float16). ``N % 16 == 0``. Returns ``N / 16 x K/32 x 576`` bytes: ``q``, ``d``, and
    each row's sum of ``q`` per group (layout: ``cpu_kernels.c``)."""
    n, k = q.shape
    b, g = n // TILE_ROWS, k // GROUP
    out = np.empty((b, g, Q8_TILE_BYTES), dtype=np.uint8)
    qg = q.reshape(b, TILE_ROWS, g, 8, 4)
    out[..., :512] = qg.transpose(0, 2, 3, 1, 4).reshape(b, g, 512).view(np.uint8)
    out[..., 512:544] = np.ascontiguousarray(d.astype(np.float16).reshape(b, TILE_ROWS, g).transpose(0, 2, 1)).view(
        np.uint8)
    sums = q.reshape(n, g, GROUP).sum(axis=-1, dtype=np.int32).astype(np.int16)  # |sum| <= 32 * 128
    out[..., 544:] = np.ascontiguousarray(sums.reshape(b, TILE_ROWS, g).transpose(0, 2, 1)).view(np.uint8)
    return torch.from_numpy(out)


def q8_tile_integers(tiles: np.ndarray) -> np.ndarray:
    """``pack_q8_tiles``' ``q`` back, ``N x K/32 x 32`` int8."""
    b, g, _ = tiles.shape
    q = tiles[..., :512].view(np.int8)
    return q.reshape(b, g, 8, TILE_ROWS, 4).transpose(0, 3, 1, 2, 4).reshape(b * TILE_ROWS, g, GROUP)


def q8_tile_scales(tiles: np.ndarray) -> np.ndarray:
    """``pack_q8_tiles``' ``d`` back (as float16 held it), ``N x K/32`` float32."""
    b, g, _ = tiles.shape
    d = np.ascontiguousarray(tiles[..., 512:544]).view(np.float16).astype(np.float32)
    return np.ascontiguousarray(d.transpose(0, 2, 1)).reshape(b * TILE_ROWS, g)


def unpack_tiles(tiles: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``pack_tiles``' inverse: (nibbles ``N x G x 16``, s, z as float32 ``N x G``)."""
    t = tiles.numpy()
    b, g, _ = t.shape
    nibbles = _from_tile_nibbles(t[..., :256])

    def halves(at: int) -> np.ndarray:
        v = np.ascontiguousarray(t[..., at : at + 32]).view(np.float16).astype(np.float32)
        return np.ascontiguousarray(v.transpose(0, 2, 1)).reshape(b * TILE_ROWS, g)

    return np.ascontiguousarray(nibbles), halves(256), halves(288)



def pack_half_tiles(bits: np.ndarray) -> np.ndarray:
    """The 16-bit kernel's weight: ``bits`` ``N x K`` uint16 (F16 or BF16) reordered into tiles of 4 rows (zero rows
    past N), each chunk of 16 columns of the tile's rows side by side (layout: ``cpu_kernels_half.h``). Returns
    ``ceil(N / 4) x K/16 x 64`` uint16: the same values, reordered."""
    n, k = bits.shape
    tiles = -(-n // HALF_TILE_ROWS)
    if n % HALF_TILE_ROWS:
        padded = np.zeros((tiles * HALF_TILE_ROWS, k), np.uint16)
        padded[:n] = bits
        bits = padded
    # moved as 32-byte items (a chunk of 16 values each): one pass over the weights, 10x numpy's element-wise copy
    chunks = np.ascontiguousarray(bits).view(np.dtype("V32")).reshape(tiles, HALF_TILE_ROWS, k // 16)
    out = np.ascontiguousarray(chunks.transpose(0, 2, 1))
    return out.view(np.uint16).reshape(tiles, k // 16, 16 * HALF_TILE_ROWS)


def unpack_half_tiles(tiles: np.ndarray, n: int) -> np.ndarray:
    """``pack_half_tiles``' inverse: ``N x K`` uint16."""
    t, chunks, _ = tiles.shape
    return tiles.reshape(t, chunks, HALF_TILE_ROWS, 16).transpose(0, 2, 1, 3).reshape(t * HALF_TILE_ROWS, -1)[:n]


def half_tile_rows(tiles: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rows ``rows`` of a ``pack_half_tiles`` weight, ``len(rows) x K`` uint16 (an embedding lookup): their tiles
    unpacked, then each row picked from its tile."""
    picked = unpack_half_tiles(tiles[rows // HALF_TILE_ROWS], HALF_TILE_ROWS * len(rows))
    return np.ascontiguousarray(picked.reshape(len(rows), HALF_TILE_ROWS, -1)[np.arange(len(rows)),
                                                                              rows % HALF_TILE_ROWS])

