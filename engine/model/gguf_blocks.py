"""A GGUF file's weights as blocks, read fast: only the tensor directory is parsed, the metadata skipped.

``gguf.GGUFReader`` builds a numpy view per metadata element (every token and merge string: ~4 s for the
bundled model); a quantized load needs only the tensor directory, so this walks the header with ``struct`` and
maps the data. Q4_0/Q4_1/Q8_0 matrices come back as ``RawBlocks``, F32/F16 tensors as float32 tensors; a file
with any other type returns None (the caller falls back to ``gguf_loader.gguf_weights``).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from tickloom.engine.model.config import ModelConfig
from tickloom.engine.model.quant import RawBlocks, Weight

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF metadata value type -> bytes (8 string and 9 array are variable)."""
_TYPES = {0: ("F32", 4, 1), 1: ("F16", 2, 1), 2: ("Q4_0", 18, 32), 3: ("Q4_1", 20, 32), 8: ("Q8_0", 34, 32)}
"""GGML tensor type -> (name, bytes per block, elements per block)."""


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> int:
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return int(v)

    def string(self) -> str:
        n = self.take("<Q")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_value(self, vtype: int) -> int | None:
        """Skip one value; return it if it is an unsigned/signed 32- or 64-bit integer (for general.alignment)."""
        if vtype == 8:
            n = self.take("<Q")  # not `self.pos += self.take(...)`: that adds to the position before the take
            self.pos += n
        elif vtype == 9:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in _SCALAR:
                self.pos += _SCALAR[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        elif vtype in (4, 5, 10, 11):
            return self.take({4: "<I", 5: "<i", 10: "<Q", 11: "<q"}[vtype])
        else:
            self.pos += _SCALAR[vtype]
        return None


def read_gguf_blocks(path: Path, cfg: ModelConfig) -> dict[str, Weight] | None:
    """The tensors the model uses, under Hugging Face names, or None if one has a type not read here."""
    from tickloom.engine.model.gguf_loader import hf_name, unpermute_rope

    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(data))  # type: ignore[arg-type]
    if bytes(data[:4]) != b"GGUF":
        return None
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("<I"), cur.take("<Q"), cur.take("<Q")
    if version < 2:
        return None
    alignment = 32
    for _ in range(n_kv):
        key = cur.string()
        value = cur.skip_value(cur.take("<I"))
        if key == "general.alignment" and value:
            alignment = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    start = -(-cur.pos // alignment) * alignment
    out: dict[str, Weight] = {}
    for name, dims, ttype, offset in infos:
        hf = hf_name(name)
        if hf is None:
            continue
        if ttype not in _TYPES:
            return None
        kind, block_bytes, per_block = _TYPES[ttype]
        shape = tuple(reversed(dims))
        cols = shape[-1]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        nbytes = rows * cols // per_block * block_bytes
        raw = data[start + offset : start + offset + nbytes].reshape(rows, -1)
        if cfg.architecture == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            raw = unpermute_rope(raw, cfg.num_heads) if len(shape) == 2 else raw
        elif cfg.architecture == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            raw = unpermute_rope(raw, cfg.num_kv_heads) if len(shape) == 2 else raw
        if kind in ("F32", "F16"):
            arr = np.ascontiguousarray(raw).view(np.float32 if kind == "F32" else np.float16).reshape(shape)
            if cfg.architecture == "llama" and len(shape) == 1 and name.endswith(("attn_q.bias", "attn_k.bias")):
                heads = cfg.num_heads if "attn_q" in name else cfg.num_kv_heads
                arr = unpermute_rope(arr, heads)
            out[hf] = torch.from_numpy(np.array(arr, dtype=np.float32))
        elif len(shape) == 2:
            out[hf] = RawBlocks(kind, np.ascontiguousarray(raw), (shape[0], shape[1]))
        else:
            return None
    return out
