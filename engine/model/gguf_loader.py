"""Reading a GGUF file (llama.cpp format) into Hugging Face-named tensors, a config and a tokenizer.

Weights are dequantized with ``gguf.quants.dequantize``; Q/K projections of ``llama`` files are
un-permuted (llama.cpp's converter interleaves rope pairs for them), and Gemma's norm weights, stored as ``1 + w``,
are given back as ``w``. The tokenizer is rebuilt with the
``tokenizers`` library from ``tokenizer.ggml.*`` metadata.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from tickloom.engine.model import gguf_quants
from tickloom.engine.model.config import FULL, SLIDING, SUPPORTED_ARCHITECTURES, ModelConfig
from tickloom.engine.model.errors import ModelLoadError
from tickloom.engine.model.gguf_blocks import hf_name, is_offset_norm, unpermute_rope
from tickloom.engine.model.quant import RawBlocks

log = logging.getLogger(__name__)

Q = GGMLQuantizationType
SUPPORTED_FAMILY_CLASSES = {family: cls for cls, family in SUPPORTED_ARCHITECTURES.items()}
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


GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
"""``general.architecture`` values read (a Mistral file is ``llama``, with its window if it has one)."""


def gguf_config(path: Path, reader: GGUFReader) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise ModelLoadError(path, f"unsupported GGUF architecture {arch!r} (supported: {supported})")
    names = {t.name for t in reader.tensors}

    def need(key: str) -> Any:
        v = field_value(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(path, f"missing GGUF metadata {arch}.{key}")
        return v

    def get(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    layers = int(need("block_count"))
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    vocab = get("vocab_size")
    if vocab is None:
        vocab = len(tokens) if tokens is not None else None
    if vocab is None:
        raise ModelLoadError(path, "cannot tell the vocabulary size (no vocab_size, no tokens)")
    head_dim = int(get("attention.key_length") or hidden // heads)
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    window = get("attention.sliding_window")
    family = "mistral" if arch == "llama" and window else arch
    ctx = int(get("context_length", 4096))
    raw: dict[str, Any] = {
        "architectures": [SUPPORTED_FAMILY_CLASSES[family]],
        "vocab_size": int(vocab), "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads), "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)), "max_position_embeddings": ctx,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in names,
        "bos_token_id": int(bos) if bos is not None else None, "eos_token_id": int(eos) if eos is not None else None,
        "sliding_window": int(window) if window else None,
    }
    if family == "phi3" and "rope_factors_long.weight" in names:
        raw["rope_scaling"] = _longrope(path, reader, arch)
    elif "rope_freqs.weight" in names:
        raw["rope_scaling"] = _freq_factors(reader, ctx)
    if arch in ("gemma2", "gemma3"):
        raw.update(_gemma_options(reader, arch, hidden, heads, head_dim, layers))
    return ModelConfig.from_hf_dict(raw, path)


def _longrope(path: Path, reader: GGUFReader, arch: str) -> dict[str, Any]:
    """Phi-3's LongRoPE settings: its two factor sets are tensors in a GGUF file."""
    factors = {t.name: [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)] for t in reader.tensors
               if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    original = field_value(reader, f"{arch}.rope.scaling.original_context_length")
    if "rope_factors_short.weight" not in factors or original is None:
        raise ModelLoadError(path, "LongRoPE needs rope_factors_short and rope.scaling.original_context_length")
    out: dict[str, Any] = {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
                           "short_factor": factors["rope_factors_short.weight"],
                           "original_max_position_embeddings": int(original)}
    attn = field_value(reader, f"{arch}.rope.scaling.attn_factor")
    if attn is not None:
        out["attention_factor"] = float(attn)
    return out


def _freq_factors(reader: GGUFReader, ctx: int) -> dict[str, Any]:
    """Llama 3.x rope scaling as llama.cpp stores it: ``rope_freqs``, per rotated pair the divisor of its
    frequency. That is LongRoPE with one factor set for all positions and no attention factor, which is how the
    converted config.json states it (the ``llama3`` parameters the factors came from are not in the file)."""
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    factors = [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
    return {"rope_type": "longrope", "short_factor": factors, "long_factor": factors,
            "original_max_position_embeddings": ctx, "attention_factor": 1.0}


def _gemma_options(reader: GGUFReader, arch: str, hidden: int, heads: int, head_dim: int,
                   layers: int) -> dict[str, Any]:
    """Gemma's options as config.json keys. A GGUF file does not carry ``query_pre_attn_scalar``: llama.cpp
    takes ``hidden / heads`` for the 27B models (46 layers in Gemma 2, 62 in Gemma 3) and ``head_dim``
    otherwise; an ``attention.scale`` key, when present, is the scale itself."""
    def get(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    scale = get("attention.scale")
    big = layers == (46 if arch == "gemma2" else 62)
    scalar = float(scale) ** -2 if scale else float(hidden // heads if big else head_dim)
    out: dict[str, Any] = {"query_pre_attn_scalar": scalar,
                           "attn_logit_softcapping": get("attn_logit_softcapping"),
                           "final_logit_softcapping": get("final_logit_softcapping"),
                           "hidden_activation": "gelu_pytorch_tanh"}
    pattern = get("attention.sliding_window_pattern")
    every = 2 if arch == "gemma2" else 6  # llama.cpp's fixed patterns when the file has none
    if isinstance(pattern, list):
        out["layer_types"] = [SLIDING if s else FULL for s in pattern]
    else:
        every = int(pattern) if pattern else every
        out["layer_types"] = [SLIDING if (i + 1) % every else FULL for i in range(layers)]
    if arch == "gemma3":
        out["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10000.0))
        kind = get("rope.scaling.type")
        if kind not in (None, "none"):
            out["rope_scaling"] = {"rope_type": kind, "factor": float(get("rope.scaling.factor", 1.0))}
    return out


def gguf_tensors(path: Path, reader: GGUFReader, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors under Hugging Face names."""
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name, cfg.architecture)
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
        if is_offset_norm(t.name, cfg.architecture):
            arr = arr - np.float32(1)
        if cfg.architecture in ("llama", "mistral"):
            if t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias"):
                arr = unpermute_rope(arr, cfg.num_heads)
            elif t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias"):
                arr = unpermute_rope(arr, cfg.num_kv_heads)
        out[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    return out


BLOCK_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    Q(i) for i, name in gguf_quants.GGML_TYPES.items() if name != "F32")
"""Types ``gguf_weights`` keeps as the file stores them (``engine.model.quant.RawBlocks``)."""


def gguf_weights(path: Path, reader: GGUFReader, cfg: ModelConfig, *,
                 quantized: bool = True) -> dict[str, torch.Tensor | RawBlocks]:
    """Like ``gguf_tensors``, but matrices of the ``BLOCK_TYPES`` stay as the file stores them (rows un-permuted
    for rope like the floats), for layers that pack them without a float32 detour. Matrices of other types
    (Q2_K, Q3_K, ...) are dequantized to float32, with a warning that says what that costs when the model is
    ``quantized`` (otherwise every weight becomes a float anyway)."""
    out: dict[str, torch.Tensor | RawBlocks] = {}
    floats = [t for t in reader.tensors if GGMLQuantizationType(int(t.tensor_type)) not in BLOCK_TYPES
              or len(t.shape) != 2]
    float_ids = {id(t) for t in floats}
    for t in reader.tensors:
        name = hf_name(t.name, cfg.architecture)
        qtype = GGMLQuantizationType(int(t.tensor_type))
        if name is None or id(t) in float_ids:
            continue
        rows = np.asarray(t.data)
        if qtype == Q.F16:
            rows = rows.view(np.uint8).reshape(rows.shape[0], -1)
        if cfg.architecture in ("llama", "mistral"):
            if t.name.endswith("attn_q.weight"):
                rows = unpermute_rope(rows, cfg.num_heads)
            elif t.name.endswith("attn_k.weight"):
                rows = unpermute_rope(rows, cfg.num_kv_heads)
        shape = (int(t.shape[1]), int(t.shape[0]))
        out[name] = RawBlocks(qtype.name, np.ascontiguousarray(rows), shape)
    if floats:
        rest = gguf_tensors(path, _Only(reader, floats), cfg)  # type: ignore[arg-type]
        if quantized:
            _warn_dequantized(path, [t for t in floats if len(t.shape) == 2
                                     and hf_name(t.name, cfg.architecture) is not None
                                     and GGMLQuantizationType(int(t.tensor_type)) not in (Q.F32, Q.F64)])
        out.update(rest)
    return out


def _warn_dequantized(path: Path, tensors: list[Any]) -> None:
    """One warning per type tickloom has no layer for: how many matrices, and the float32 memory they take."""
    by_type: dict[str, list[Any]] = {}
    for t in tensors:
        by_type.setdefault(GGMLQuantizationType(int(t.tensor_type)).name, []).append(t)
    for kind, ts in sorted(by_type.items()):
        floats = sum(int(np.prod(t.shape)) * 4 for t in ts)
        stored = sum(int(t.n_bytes) for t in ts)
        log.warning("%s: %d matrices (%r, ...) are %s, which tickloom has no packed form of: dequantized to "
                    "float32, %.1f MB of memory (%.1f MB in the file), then quantized again for the setting",
                    path.name, len(ts), ts[0].name, kind, floats / 1e6, stored / 1e6)


class _Only:
    """A reader view with only some of its tensors."""

    def __init__(self, reader: GGUFReader, tensors: list[Any]) -> None:
        self.tensors = tensors
        self.fields = reader.fields


_SPM_SPACE = "\u2581"
"""SentencePiece's stand-in for a space (``▁``)."""


def _spm_tokenizer(tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool) -> Tokenizer:
    """llama.cpp's ``llama`` tokenizer (SentencePiece BPE: Llama 2, Mistral, Gemma, Phi-3) as a ``tokenizers`` BPE.

    SentencePiece merges, among adjacent pieces, the pair whose joined piece is in the vocabulary with the highest
    score; a BPE whose merges are every such split of every normal piece, ranked by the joined piece's score, makes
    the same choices. Characters outside the vocabulary become their UTF-8 bytes (``<0x..>`` tokens). Spaces are
    ``▁``, with one in front of the text unless the file says ``add_space_prefix`` false (Gemma)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, piece in enumerate(tokens):
        if types[i] not in (1, 4) or len(piece) < 2:  # normal and user pieces only: not control, byte, unknown
            continue
        for cut in range(1, len(piece)):
            a, b = piece[:cut], piece[cut:]
            if a in vocab and b in vocab:
                ranked.append((-scores[i], vocab[a], vocab[b], a, b))
    ranked.sort()
    unk = next((tokens[i] for i, ty in enumerate(types) if ty == 2), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked], unk_token=unk, fuse_unk=True,
                               byte_fallback=True))
    steps: list[Any] = [normalizers.Prepend(_SPM_SPACE)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPM_SPACE)])
    undo: list[Any] = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*undo, decoders.Strip(" ", 1, 0)] if add_space_prefix else undo)
    return tok


def gguf_tokenizer(path: Path, reader: GGUFReader) -> tuple[Tokenizer, dict[str, Any]]:
    """The file's tokenizer (byte-level BPE ``gpt2``, or SentencePiece ``llama``) and a tokenizer_config dict
    (chat template, bos/eos)."""
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelLoadError(path, f"unsupported GGUF tokenizer model {kind!r} (supported: byte-level BPE 'gpt2', "
                                   "SentencePiece 'llama')")
    tokens: list[str] = list(field_value(reader, "tokenizer.ggml.tokens") or [])
    merges_raw: list[str] = list(field_value(reader, "tokenizer.ggml.merges") or [])
    types: list[int] = list(field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    if not tokens:
        raise ModelLoadError(path, "GGUF has no tokenizer.ggml.tokens")
    if kind == "llama":
        scores = [float(x) for x in field_value(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)]
        prefix = bool(field_value(reader, "tokenizer.ggml.add_space_prefix", True))
        return _with_specials(reader, _spm_tokenizer(tokens, scores, types, prefix), tokens, types)
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
    return _with_specials(reader, tok, tokens, types)


def _with_specials(reader: GGUFReader, tok: Tokenizer, tokens: list[str],
                   types: list[int]) -> tuple[Tokenizer, dict[str, Any]]:
    """Control and user-defined tokens added whole, bos prepended when the file asks, and the config dict."""
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
