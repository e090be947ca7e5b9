"""A GGUF file's weights as blocks, read fast: only the tensor directory is parsed, the metadata skipped.

``gguf.GGUFReader`` builds a numpy view per metadata element (every token and merge string: ~4 s for the
bundled model); a load needs only the tensor directory, so this walks the header with ``struct`` and maps the
data. Matrices of the types in ``gguf_quants.BLOCKS`` come back as ``RawBlocks`` (views of the mapping, nothing
copied), F32 matrices and every vector (norms, biases) as float32 tensors; a file with any other type returns None
(the caller falls back to ``gguf_loader.gguf_weights``). ``read_gguf_header`` reads a few metadata values too (the
chat template, for the command line's defaults) in the same walk.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tickloom.engine.model import gguf_quants
from tickloom.engine.model.config import ModelConfig
from tickloom.engine.model.quant import RawBlocks, Weight

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF metadata value type -> bytes (8 string and 9 array are variable)."""


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

    def value(self, vtype: int) -> object:
        """One value: a string, a number or a bool (an array is skipped: None)."""
        if vtype == 8:
            return self.string()
        if vtype in _FORMATS:
            (v,) = struct.unpack_from(_FORMATS[vtype], self.buf, self.pos)
            self.pos += _SCALAR[vtype]
            return bool(v) if vtype == 7 else v
        self.skip_value(vtype)
        return None

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
_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
"""GGUF metadata scalar type -> struct format."""


@dataclass(slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    """Row-major (the GGUF's dims reversed)."""
    type_id: int
    offset: int
    """From the start of the data section."""

    @property
    def kind(self) -> str | None:
        """The type's name if tickloom reads it as it is (``gguf_quants.BLOCKS``), else None."""
        return gguf_quants.GGML_TYPES.get(self.type_id)

    @property
    def type_name(self) -> str:
        return gguf_quants.GGML_TYPE_NAMES.get(self.type_id, f"type {self.type_id}")


@dataclass(slots=True)
class GGUFHeader:
    data: np.memmap
    tensors: list[TensorInfo]
    data_start: int
    metadata: dict[str, object] = field(default_factory=dict)
    """The values of the keys asked for that the file has (arrays are not read)."""

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes as ``rows x row bytes`` (a view of the mapping)."""
        size, per = gguf_quants.BLOCKS[t.kind or "F32"]
        cols = t.shape[-1]
        rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
        at = self.data_start + t.offset
        return self.data[at : at + rows * (cols // per) * size].reshape(rows, -1)


def read_gguf_header(path: Path, keys: tuple[str, ...] = ()) -> GGUFHeader | None:
    """The tensor directory and the metadata values of ``keys``, or None if this is not a GGUF file (version 2
    or later)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    if len(data) < 24 or bytes(data[:4]) != b"GGUF":
        return None
    cur = _Cursor(memoryview(data))  # type: ignore[arg-type]
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("<I"), cur.take("<Q"), cur.take("<Q")
    if version < 2:
        return None
    alignment = 32
    wanted: dict[str, object] = {}
    for _ in range(n_kv):
        key = cur.string()
        vtype = cur.take("<I")
        if key in keys:
            wanted[key] = cur.value(vtype)
            continue
        value = cur.skip_value(vtype)
        if key == "general.alignment" and value:
            alignment = value
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        infos.append(TensorInfo(name, tuple(reversed(dims)), cur.take("<I"), cur.take("<Q")))
    start = -(-cur.pos // alignment) * alignment
    return GGUFHeader(data, infos, start, wanted)


def read_gguf_blocks(path: Path, cfg: ModelConfig) -> dict[str, Weight] | None:
    """The tensors the model uses, under Hugging Face names, or None if one has a type not read here."""
    header = read_gguf_header(path)
    if header is None:
        return None
    arch = cfg.architecture
    out: dict[str, Weight] = {}
    for t in header.tensors:
        hf = hf_name(t.name, arch)
        if hf is None:
            continue
        kind = t.kind
        if kind is None or len(t.shape) > 2:
            return None
        name, shape = t.name, t.shape
        raw = header.tensor_bytes(t)
        if _permutes(arch) and len(shape) == 2 and name.endswith("attn_q.weight"):
            raw = unpermute_rope(raw, cfg.num_heads)
        elif _permutes(arch) and len(shape) == 2 and name.endswith("attn_k.weight"):
            raw = unpermute_rope(raw, cfg.num_kv_heads)
        if len(shape) == 2 and kind != "F32" and not is_offset_norm(name, arch):
            out[hf] = RawBlocks(kind, np.ascontiguousarray(raw), (shape[0], shape[1]))
            continue
        arr = gguf_quants.dequantize(kind, raw).reshape(shape)
        if is_offset_norm(name, arch):
            arr = arr - np.float32(1)
        if _permutes(arch) and len(shape) == 1 and name.endswith(("attn_q.bias", "attn_k.bias")):
            arr = unpermute_rope(arr, cfg.num_heads if "attn_q" in name else cfg.num_kv_heads)
        out[hf] = torch.from_numpy(np.array(arr, dtype=np.float32))
    return out
