"""Packing 4-bit weights into the layout of torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) with numpy.

Why: ``aten._convert_weight_to_int4pack_for_cpu`` takes the values as an ``N x K`` int32 tensor, so a load first
widens every 4-bit value to 4 bytes and then packs it: for the bundled model that was ~0.3 s of a ~1 s load.
Here a GGUF Q4 tensor's nibble bytes are rearranged straight into the packed bytes, one pass per step.

The layout (torch 2.x on x86): output rows in blocks of ``B`` (64 with AVX512, 32 otherwise); within a block,
for each input column ``k``, byte ``d`` (``d < B/2``) holds row ``d``'s value in its low nibble and row
``d + B/2``'s in its high nibble, so a block is ``K x B/2`` bytes. It is torch's private format, so it is not
assumed: ``block_rows`` packs a random probe with torch and uses the numpy path only if one ``B`` reproduces it
byte for byte; otherwise (another torch or CPU), every caller falls back to torch's own packing.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

_INT4_PACK = torch.ops.aten._convert_weight_to_int4pack_for_cpu.default


def pack_values(q: np.ndarray, rows: int) -> np.ndarray:
    """``q``: ``N x K`` values in 0..15 (any integer dtype); ``N % rows == 0``. The packed ``N x K/2`` bytes."""
    n, k = q.shape
    qr = q.astype(np.uint8, copy=False).reshape(n // rows, 2, rows // 2, k)
    out = qr[:, 0] | (qr[:, 1] << 4)
    return np.ascontiguousarray(out.transpose(0, 2, 1)).reshape(n, k // 2)


def pack_gguf_nibbles(qs: np.ndarray, rows: int) -> np.ndarray:
    """``qs``: a GGUF Q4_0/Q4_1 tensor's nibble bytes, ``N x G x 16`` (byte ``j`` of block ``g`` holds element
    ``32 g + j`` low and ``32 g + 16 + j`` high). The packed ``N x 16 G`` bytes, without unpacking the values."""
    n, g, _ = qs.shape
    qr = qs.reshape(n // rows, 2, rows // 2, g, 16)
    a, b = qr[:, 0], qr[:, 1]  # rows d and d + rows/2 of each block
    out = np.empty((n // rows, g, 2, 16, rows // 2), dtype=np.uint8)  # block, group, half, j, d
    out[:, :, 0] = ((a & 0x0F) | (b << 4)).transpose(0, 2, 3, 1)
    out[:, :, 1] = ((a >> 4) | (b & 0xF0)).transpose(0, 2, 3, 1)
    return out.reshape(n, g * 16)


@functools.cache
def block_rows() -> int | None:
    """The ``B`` whose layout matches torch's packing on this machine, else None."""
    probe = np.random.default_rng(0).integers(0, 16, (128, 64), dtype=np.int32)
    want = _INT4_PACK(torch.from_numpy(probe), 2).numpy()
    for rows in (64, 32):
        if want.shape == (128, 32) and np.array_equal(pack_values(probe, rows), want):
            return rows
    return None


def pack(q: np.ndarray) -> torch.Tensor:
    """``q``: ``N x K`` values in 0..15. torch's packed weight, from numpy when the layout is known."""
    rows = block_rows()
    if rows is not None and q.shape[0] % rows == 0:
        return torch.from_numpy(pack_values(q, rows))
    packed: torch.Tensor = _INT4_PACK(torch.from_numpy(q.astype(np.int32)), 2)
    return packed


def pack_nibbles(qs: np.ndarray) -> torch.Tensor:
    """``qs``: GGUF nibble bytes ``N x G x 16``. torch's packed weight."""
    rows = block_rows()
    if rows is not None and qs.shape[0] % rows == 0:
        return torch.from_numpy(pack_gguf_nibbles(qs, rows))
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(qs.shape[0], -1)
    packed: torch.Tensor = _INT4_PACK(torch.from_numpy(q.astype(np.int32)), 2)
    return packed
