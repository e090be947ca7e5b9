"""GGUF tensors into the integer kernels' tiles at load, in C (``native.pack_gguf_tiles``, ``cpu_kernels_pack.h``),
straight from the file's blocks: Q4_0, Q4_1 and Q4_K into ``packing.pack_tiles``' 4-bit tiles, Q5_0, Q5_1 and Q5_K
into ``pack_wide_tiles``' 5-bit ones, Q6_K into ``pack_q6_tiles``', Q8_0 into ``pack_q8_tiles``'. The same bytes as
those numpy packers fed by ``gguf_quants`` (``tests/test_model_fast_pack.py``), which stay the reference and the path
where the kernels do not run; a 1B model's load took seconds of numpy widening and transposing, where this is one
pass over the bytes with no temporaries.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tickloom.engine.model import gguf_quants, native, packing

TILE_KINDS: dict[int, tuple[str, ...]] = {4: gguf_quants.INT4_KINDS, 5: gguf_quants.INT5_KINDS, 6: ("Q6_K",),
                                          8: ("Q8_0",)}
"""Tile bits -> the GGUF types packed into those tiles."""


def enabled() -> bool:
    """Whether layers pack GGUF blocks here rather than in numpy: wherever the kernels run (the layers that read
    these tiles are built only there). Tests switch it off to compare the two."""
    return native.available()


def packs(parts: Sequence[tuple[str, np.ndarray]]) -> bool:
    """Whether ``pack_gguf`` makes these parts' tiles here: the kernels run (``enabled``), every part's type makes
    the same tiles, and every part's rows come in sixteens. The one test every layer that packs in C asks."""
    bits = {tile_bits(kind) for kind, _ in parts}
    return (enabled() and len(bits) == 1 and None not in bits
            and all(data.shape[0] % packing.TILE_ROWS == 0 for _, data in parts))


def tile_bits(kind: str) -> int | None:
    """The tiles (4, 5, 6 or 8 bits) ``pack_gguf`` makes of GGUF type ``kind``, or None when it takes no such type."""
    return next((bits for bits, kinds in TILE_KINDS.items() if kind in kinds), None)


def pack_gguf(parts: Sequence[tuple[str, np.ndarray]]) -> torch.Tensor:
    """GGUF tensors ``(kind, raw bytes N_i x row bytes)`` stacked along the output axis, as one weight's tiles:
    ``N/16 x K/32 x`` tile bytes uint8 (Q6_K: ``N/16 x K/256 x`` a super-block's bytes), ``N = sum N_i``. Every
    part makes the same tiles (Q4_0/Q4_1/Q4_K: 4 bits; Q5_0/Q5_1/Q5_K: 5; Q6_K: 6; Q8_0: 8), has rows in
    sixteens (so no tile mixes two parts: each part fills its own row blocks) and the same K. ``ValueError`` names
    what does not fit."""
    if not parts:
        raise ValueError("pack_gguf: no parts")
    bits = {tile_bits(kind) for kind, _ in parts}
    if None in bits or len(bits) != 1:
        kinds = [kind for kind, _ in parts]
        raise ValueError(f"pack_gguf: {kinds} do not make one kind of tile (one of {TILE_KINDS})")
    ks: set[int] = set()
    for kind, data in parts:
        size, per = gguf_quants.BLOCKS[kind]
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] % size:
            raise ValueError(f"pack_gguf: {kind} data {data.shape} {data.dtype} is not N x whole {size}-byte blocks")
        if data.shape[0] % packing.TILE_ROWS:
            raise ValueError(f"pack_gguf: {kind} part of {data.shape[0]} rows: rows must come in sixteens")
        ks.add(data.shape[1] // size * per)
    if len(ks) != 1:
        raise ValueError(f"pack_gguf: the parts' input sizes differ ({sorted(ks)})")
    k = ks.pop()
    if k % packing.GROUP or k == 0:
        raise ValueError(f"pack_gguf: input size {k} is not a positive multiple of {packing.GROUP}")
    n = sum(data.shape[0] for _, data in parts)
    kind0 = parts[0][0]
    out = packing.tile_buffer(n // packing.TILE_ROWS, k // native.PACKED_UNIT_K.get(kind0, packing.GROUP),
                              native.PACKED_TILE_BYTES[kind0])
    at = 0
    for kind, data in parts:
        blocks = data if data.strides[1] == 1 else np.ascontiguousarray(data)
        rows = data.shape[0] // packing.TILE_ROWS
        native.pack_gguf_tiles(kind, blocks, out[at : at + rows])
        at += rows
    return out
