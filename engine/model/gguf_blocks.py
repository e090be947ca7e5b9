"""A GGUF file's weights as blocks, read fast: only the tensor directory is parsed, the metadata skipped.

``gguf.GGUFReader`` builds a numpy view per metadata element (every token and merge string: ~4 s for the
bundled model); a quantized load needs only the tensor directory, so this walks the header with ``struct`` and
maps the data. Q4_0/Q4_1/Q8_0 matrices come back as ``RawBlocks``, F32/F16 tensors as float32 tensors; a file
with any other type returns None (the caller falls back to ``gguf_loader.gguf_weights``).
"""

from __future__ import annotations

import re
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


_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {
    # Gemma's four norms: llama.cpp's ffn_norm is the norm before the MLP, HF's pre_feedforward_layernorm
    "gemma2": {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_attention_norm.weight": "post_attention_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    # Phi-3's fused projections: attn_qkv, and ffn_up holding gate and up
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
_ARCH_LAYER_NAMES["gemma3"] = _ARCH_LAYER_NAMES["gemma2"]
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
NORM_OFFSET_ARCHS = ("gemma2", "gemma3")
"""GGUF architectures whose norm weights llama.cpp's converter stores with 1 added (HF's ``w`` as ``1 + w``)."""


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a GGUF tensor of architecture ``arch`` (the GGUF's, or the family's: the same
    names except Mistral, which GGUF files call ``llama``); None for a tensor the model does not load."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _BLK.match(gguf_name)
    if m is None:
        return None
    local = _ARCH_LAYER_NAMES.get(arch, {}).get(m.group(2)) or _LAYER_NAMES.get(m.group(2))
    return None if local is None else f"model.layers.{m.group(1)}.{local}"


def is_offset_norm(gguf_name: str, arch: str) -> bool:
    """Whether this tensor is a norm weight stored as ``1 + w`` (subtract 1 for the HF form)."""
    return arch in NORM_OFFSET_ARCHS and gguf_name.endswith("norm.weight")


def _permutes(arch: str) -> bool:
    """llama.cpp's converter interleaves rope pairs in Q/K rows for Llama-format files (Mistral's included)."""
    return arch in ("llama", "mistral")


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (pairs interleaved back to rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)



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
            elif etype == 8:
                self._skip_strings(count)
            else:
                for _ in range(count):
                    self.skip_value(etype)
        elif vtype in (4, 5, 10, 11):
            return self.take({4: "<I", 5: "<i", 10: "<Q", 11: "<q"}[vtype])
        else:
            self.pos += _SCALAR[vtype]
        return None

    def _skip_strings(self, count: int) -> None:
        """Skip ``count`` strings. The bundled model's vocabulary and merges are ~100,000 of them: a plain loop
        here, not a method call per string, is the difference between 0.02 s and 0.2 s of every load."""
        unpack, buf, pos = _U64.unpack_from, self.buf, self.pos
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        self.pos = pos


_U64 = struct.Struct("<Q")


def read_gguf_blocks(path: Path, cfg: ModelConfig) -> dict[str, Weight] | None:
    """The tensors the model uses, under Hugging Face names, or None if one has a type not read here."""
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
        hf = hf_name(name, cfg.architecture)
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
        if _permutes(cfg.architecture) and name.endswith(("attn_q.weight", "attn_q.bias")):
            raw = unpermute_rope(raw, cfg.num_heads) if len(shape) == 2 else raw
        elif _permutes(cfg.architecture) and name.endswith(("attn_k.weight", "attn_k.bias")):
            raw = unpermute_rope(raw, cfg.num_kv_heads) if len(shape) == 2 else raw
        if kind in ("F32", "F16"):
            arr = np.ascontiguousarray(raw).view(np.float32 if kind == "F32" else np.float16).reshape(shape)
            if _permutes(cfg.architecture) and len(shape) == 1 and name.endswith(("attn_q.bias", "attn_k.bias")):
                heads = cfg.num_heads if "attn_q" in name else cfg.num_kv_heads
                arr = unpermute_rope(arr, heads)
            f32 = torch.from_numpy(np.array(arr, dtype=np.float32))
            out[hf] = f32 - 1 if is_offset_norm(name, cfg.architecture) else f32
        elif is_offset_norm(name, cfg.architecture):
            return None  # a quantized norm weight: the slow reader dequantizes it
        elif len(shape) == 2:
            out[hf] = RawBlocks(kind, np.ascontiguousarray(raw), (shape[0], shape[1]))
        else:
            return None
    return out
