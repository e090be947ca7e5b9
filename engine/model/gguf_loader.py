"""Reading a GGUF file (llama.cpp format) into Hugging Face-named tensors, a config and a tokenizer.

Weights are dequantized with ``gguf.quants.dequantize``; Q/K projections of ``llama`` files are
un-permuted (llama.cpp's converter interleaves rope pairs for them). The tokenizer is rebuilt with the
``tokenizers`` library from ``tokenizer.ggml.*`` metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from tickloom.engine.model.config import ModelConfig
from tickloom.engine.model.errors import ModelLoadError
from tickloom.engine.model.gguf_blocks import hf_name, unpermute_rope
from tickloom.engine.model.quant import RawBlocks

Q = GGMLQuantizationType
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {Q.F32, Q.F16, Q.BF16, Q.F64, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
)

# Pre-tokenizer regexes by ``tokenizer.ggml.pre`` (behaviour as documented by llama.cpp).
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def field_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def open_gguf(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ModelLoadError(path, "GGUF file not found")
    try:
        return GGUFReader(str(path))
    except Exception as exc:
        raise ModelLoadError(path, f"not a readable GGUF file: {exc}") from exc


def gguf_config(path: Path, reader: GGUFReader) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(path, f"unsupported GGUF architecture {arch!r} (supported: llama, qwen2)")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ModelLoadError(path, "rope_freqs (GGUF Llama-3.1 rope scaling) is not supported")

    def need(key: str) -> Any:
        v = field_value(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(path, f"missing GGUF metadata {arch}.{key}")
        return v

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    vocab = field_value(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(tokens) if tokens is not None else None
    if vocab is None:
        raise ModelLoadError(path, "cannot tell the vocabulary size (no vocab_size, no tokens)")
    head_dim = field_value(reader, f"{arch}.attention.key_length") or hidden // heads
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(field_value(reader, f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(field_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(field_value(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field_value(reader, f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
        rope_scaling=None,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=(int(eos),) if eos is not None else (),
    )


def gguf_tensors(path: Path, reader: GGUFReader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors under Hugging Face names."""
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        qtype = GGMLQuantizationType(int(t.tensor_type))
        if qtype not in SUPPORTED_TYPES:
            raise ModelLoadError(path, f"tensor {t.name!r} uses unsupported GGUF type {qtype.name}")
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        try:
            arr = dequantize(t.data, qtype)
        except (NotImplementedError, ValueError) as exc:
            raise ModelLoadError(path, f"cannot dequantize {t.name!r} ({qtype.name}): {exc}") from exc
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        if cfg.architecture == "llama":
            if t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias"):
                arr = unpermute_rope(arr, cfg.num_heads)
            elif t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias"):
                arr = unpermute_rope(arr, cfg.num_kv_heads)
        out[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    return out


BLOCK_TYPES: frozenset[GGMLQuantizationType] = frozenset({Q.Q4_0, Q.Q4_1, Q.Q8_0})
"""Types ``gguf_weights`` keeps in block form (``engine.model.quant.RawBlocks``) for quantized loading."""


def gguf_weights(path: Path, reader: GGUFReader, cfg: ModelConfig) -> dict[str, torch.Tensor | RawBlocks]:
    """Like ``gguf_tensors``, but Q4_0/Q4_1/Q8_0 matrices stay as their raw blocks (rows un-permuted for
    rope like the floats), for layers that pack them without a float32 detour."""
    out: dict[str, torch.Tensor | RawBlocks] = {}
    floats = [t for t in reader.tensors if GGMLQuantizationType(int(t.tensor_type)) not in BLOCK_TYPES
              or len(t.shape) != 2]
    float_ids = {id(t) for t in floats}
    for t in reader.tensors:
        name = hf_name(t.name)
        qtype = GGMLQuantizationType(int(t.tensor_type))
        if name is None or id(t) in float_ids:
            continue
        rows = np.asarray(t.data)
        if cfg.architecture == "llama":
            if t.name.endswith("attn_q.weight"):
                rows = unpermute_rope(rows, cfg.num_heads)
            elif t.name.endswith("attn_k.weight"):
                rows = unpermute_rope(rows, cfg.num_kv_heads)
        shape = (int(t.shape[1]), int(t.shape[0]))
        out[name] = RawBlocks(qtype.name, np.ascontiguousarray(rows), shape)
    if floats:
        rest = gguf_tensors(path, _Only(reader, floats), cfg)  # type: ignore[arg-type]
        out.update(rest)
    return out


class _Only:
    """A reader view with only some of its tensors."""

    def __init__(self, reader: GGUFReader, tensors: list[Any]) -> None:
        self.tensors = tensors
        self.fields = reader.fields


def gguf_tokenizer(path: Path, reader: GGUFReader) -> tuple[Tokenizer, dict[str, Any]]:
    """A byte-level BPE tokenizer and a tokenizer_config dict (chat template, bos/eos)."""
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(path, f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2')")
    tokens: list[str] = list(field_value(reader, "tokenizer.ggml.tokens") or [])
    merges_raw: list[str] = list(field_value(reader, "tokenizer.ggml.merges") or [])
    types: list[int] = list(field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    if not tokens:
        raise ModelLoadError(path, "GGUF has no tokenizer.ggml.tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    for m in merges_raw:
        a, _, b = m.partition(" ")
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = str(field_value(reader, "tokenizer.ggml.pre", "default"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_RE), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_RE), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre in ("smollm", "starcoder", "refact", "codeshell"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=False) if ty == 3]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types, strict=False) if ty == 4]
    tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)
    bos_id = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos_id = field_value(reader, "tokenizer.ggml.eos_token_id")
    bos = tokens[int(bos_id)] if bos_id is not None and int(bos_id) < len(tokens) else None
    eos = tokens[int(eos_id)] if eos_id is not None and int(eos_id) < len(tokens) else None
    if bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, int(bos_id))]
        )
    tok_cfg: dict[str, Any] = {
        "bos_token": bos,
        "eos_token": eos,
        "chat_template": field_value(reader, "tokenizer.chat_template"),
        "add_bos_token": bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return tok, tok_cfg
