"""Writes a checkpoint directory as a GGUF file the way llama.cpp's convert_hf_to_gguf.py lays it out (tensor names
from the gguf package's map, Llama's q/k permutation, Gemma's norms as 1 + w, Llama 3's rope_freqs), for the
architecture tests."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_GGUF_ARCH = {"qwen2": "QWEN2", "qwen3": "QWEN3", "mistral": "LLAMA", "llama": "LLAMA", "gemma2": "GEMMA2",
              "gemma3_text": "GEMMA3", "phi3": "PHI3"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation for Llama-format files (rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(p: dict[str, Any], dim: int) -> list[float]:
    """llama.cpp's ``rope_freqs`` for Llama 3 scaling: per pair, the divisor of the frequency."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * p["rope_theta"] ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def add_llama_shape(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """The shape keys every llama.cpp architecture has, from a config.json."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])


def add_gpt2_tokenizer(w: gguf.GGUFWriter, tokenizer_json: Path) -> None:
    """A tiny model's byte-level BPE vocabulary (``tokenizer.json``) as a GGUF "gpt2" tokenizer, BOS 0."""
    vocab = sorted(json.loads(tokenizer_json.read_text())["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t.startswith("<|") else 1 for t, _ in vocab])
    w.add_token_merges([])
    w.add_bos_token_id(0)


def write_gguf(d: Path, model_type: str, out: Path, q8: bool = False, half: str | None = None) -> Path:
    """A GGUF of checkpoint ``d``'s weights as llama.cpp's converter lays them out: float32, or the matrices as Q8_0
    (``q8``) or ``half`` ("F16" or "BF16"), the token embedding as float32 either way."""
    from safetensors.torch import load_file

    cfg = json.loads((d / "config.json").read_text())
    arch = gguf.MODEL_ARCH[_GGUF_ARCH[model_type]]
    layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch, layers)
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    add_llama_shape(w, cfg)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("full_attention", rope).get("rope_theta", 10000.0)))
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if model_type in GEMMA_TYPES:
        if cfg.get("attn_logit_softcapping") is not None:
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        if cfg.get("final_logit_softcapping") is not None:
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if cfg["query_pre_attn_scalar"] != cfg["head_dim"]:
            w.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)
    if model_type == "gemma3_text":
        full, local = rope["full_attention"], rope["sliding_attention"]
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
        w.add_float32(gguf.Keys.Rope.FREQ_BASE_SWA.format(arch=w.arch), local["rope_theta"])
    if model_type == "phi3":
        orig = cfg["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(cfg["max_position_embeddings"] / orig)
                                                  / math.log(orig)))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", np.asarray(_llama3_factors(rope, cfg["head_dim"]), dtype=np.float32))
    if model_type in ("mistral", "phi3", *GEMMA_TYPES):  # their files' tokenizer: SentencePiece
        tokens, scores, types = spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_add_space_prefix(model_type not in GEMMA_TYPES)
        w.add_bos_token_id(1)
    else:
        add_gpt2_tokenizer(w, d / "tokenizer.json")
    w.add_eos_token_id(2)
    for name, t in load_file(str(d / "model.safetensors")).items():
        base, _, suffix = name.rpartition(".")
        gname = names.get_name(base)
        assert gname is not None, name
        arr = t.float().numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and gname.endswith("attn_q"):
            arr = _permute(arr, cfg["num_attention_heads"])
        elif arch == gguf.MODEL_ARCH.LLAMA and gname.endswith("attn_k"):
            arr = _permute(arr, cfg["num_key_value_heads"])
        if model_type in GEMMA_TYPES and base.endswith("norm"):
            arr = arr + 1  # llama.cpp's Gemma converters store the norm weight as 1 + w
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if (q8 or half) and arr.ndim == 2 and "token_embd" not in gname:
            qtype = gguf.GGMLQuantizationType.Q8_0 if q8 else gguf.GGMLQuantizationType[half or ""]
            w.add_tensor(f"{gname}.{suffix}", gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(f"{gname}.{suffix}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


GEMMA_TYPES = ("gemma2", "gemma3_text")


SPM_PIECES = [("▁", -1.0), ("t", -50.0), ("h", -50.0), ("e", -50.0), ("l", -50.0), ("o", -50.0), ("a", -50.0),
              ("w", -50.0), ("r", -50.0), ("d", -50.0), ("▁t", -5.0), ("he", -4.0), ("▁the", -3.0), ("ll", -2.0),
              ("llo", -6.0), ("▁he", -7.0), ("▁hello", -8.0), ("▁a", -9.0), ("lo", -1.5), ("or", -10.0),
              ("ld", -11.0), ("▁w", -12.0), ("▁wor", -13.0), ("▁world", -14.0), ("▁▁", -15.0), ("é", -16.0)]


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *(p for p, _ in SPM_PIECES),
              "<start_of_turn>"]
    scores = [0.0] * 259 + [sc for _, sc in SPM_PIECES] + [0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES) + [3]
    return tokens, scores, types


def spm_reference(text: str, add_prefix: bool) -> list[int]:
    """llama.cpp's SentencePiece tokenization, written out: control tokens split the text; in each piece of text
    (after a control token or at the start, with a space in front), the adjacent pair whose join has the highest
    score is merged (leftmost on ties) until none joins; what is left outside the vocabulary becomes bytes."""
    tokens, scores, types = spm_vocab()
    ids = {t: i for i, t in enumerate(tokens)}
    controls = [t for t, ty in zip(tokens, types, strict=True) if ty == 3]
    out: list[int] = []
    rest, prev_special = text, True
    while rest:
        at = min(((rest.find(c), c) for c in controls if c in rest), default=(len(rest), ""))
        if at[0] == 0:
            out.append(ids[at[1]])
            rest, prev_special = rest[len(at[1]) :], True
            continue
        seg, rest = rest[: at[0]], rest[at[0] :]
        syms = list(((" " if add_prefix and prev_special else "") + seg).replace(" ", "▁"))
        while True:
            best: tuple[float, int] | None = None
            for i in range(len(syms) - 1):
                j = ids.get(syms[i] + syms[i + 1])
                if j is not None and types[j] == 1 and (best is None or scores[j] > best[0]):
                    best = (scores[j], i)
            if best is None:
                break
            syms[best[1] : best[1] + 2] = [syms[best[1]] + syms[best[1] + 1]]
        for sym in syms:
            out.extend([ids[sym]] if sym in ids else [ids[f"<0x{b:02X}>"] for b in sym.encode()])
        prev_special = False
    return out


def write_spm_gguf(out: Path, add_prefix: bool) -> Path:
    tokens, scores, types = spm_vocab()
    w = gguf.GGUFWriter(str(out), "gemma2")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(add_prefix)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
