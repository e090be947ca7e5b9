"""Model architecture configuration: Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text) and Phi-3.

``ModelConfig`` holds what the forward needs, in one shape for every family; ``from_hf_dict`` reads a Hugging Face
``config.json`` (both transformers 4's and 5's spellings of the rope settings) and refuses what tickloom does not
implement, naming it. ``engine.model.arch`` derives the per-layer options the forward reads.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tickloom.engine.model.errors import ModelLoadError
from tickloom.engine.model.rope import SCALING_TYPES, scaled_inv_freq, scaling_kind

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
"""Hugging Face ``architectures`` name -> tickloom's family name."""
_CLASS_OF = {family: cls for cls, family in SUPPORTED_ARCHITECTURES.items()}
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                "gemma3_text": "gemma3", "phi3": "phi3"}
"""``model_type`` -> family, for a config without ``architectures``."""
GEMMA = ("gemma2", "gemma3")
SLIDING, FULL = "sliding_attention", "full_attention"
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the forward pass needs to know about the architecture."""

    architecture: str  # a value of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Options of the newer families; their defaults are Llama's (``to_dict`` leaves a default out).
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    """Per layer, ``sliding_attention`` (keys within ``sliding_window`` positions) or ``full_attention``; empty
    when no layer has a window."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (Gemma); None: ``head_dim ** -0.5``."""
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    """Rope base of the sliding-window layers, unscaled (Gemma 3); None: they rotate as the global layers do."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        """The fields, less the newer families' options at their defaults (so a Llama or Qwen2 model's weight
        fingerprint, which hashes this, is what it was before they existed)."""
        out = asdict(self)
        for name, default in _OPTION_DEFAULTS.items():
            if out[name] == default:
                del out[name]
        return out

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a Hugging Face checkpoint with this architecture would carry (``from_hf_dict`` reads it
        back as this config)."""
        eos: int | list[int] | None
        eos = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        family = self.architecture
        out: dict[str, Any] = {
            "architectures": [_CLASS_OF[family]],
            "model_type": "gemma3_text" if family == "gemma3" else family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "rope_scaling": self.rope_scaling,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": "float32",
        }
        if family == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        if family in ("qwen3", "gemma2", "gemma3"):
            out["attention_bias"] = self.attention_bias
        if family in ("mistral", "phi3", *GEMMA):  # these default to a window when the key is absent: write null
            out["sliding_window"] = self.sliding_window
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
            # Mistral and Phi-3 window every layer; transformers takes a Mistral config with layer_types for Ministral
            if family not in ("mistral", "phi3") or set(self.layer_types) != {SLIDING}:
                out["layer_types"] = list(self.layer_types)
            if family in ("qwen2", "qwen3"):
                out["use_sliding_window"] = True
        if family == "phi3":
            out["pad_token_id"] = None  # transformers' Phi-3 default (32000) is a token of the real vocabulary
        if family in GEMMA:
            out["hidden_activation"] = self.hidden_act
            q = self.query_pre_attn_scalar
            out["query_pre_attn_scalar"] = int(q) if q is not None and q.is_integer() else q
            out["attn_logit_softcapping"] = self.attn_logit_softcapping
            out["final_logit_softcapping"] = self.final_logit_softcapping
        if self.rope_local_theta is not None:
            out["rope_local_base_freq"] = self.rope_local_theta
        if scaling_kind(self.rope_scaling) == "longrope" and self.rope_scaling is not None:
            out["original_max_position_embeddings"] = self.rope_scaling["original_max_position_embeddings"]
        return out

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: object = "config.json") -> ModelConfig:
        raw = text_part(raw)
        family = _family(raw, source)
        try:
            return _parse(cls, family, raw, source)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(source, f"bad or missing config field: {exc!r}") from exc

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ModelLoadError(path, "config.json not found") from exc
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(path, f"unreadable config: {exc}") from exc
        if not isinstance(raw, dict):
            raise ModelLoadError(path, "config.json is not a JSON object")
        return cls.from_hf_dict(raw, path)


_OPTION_DEFAULTS: dict[str, Any] = {"hidden_act": "silu", "sliding_window": None, "layer_types": (),
                                    "query_pre_attn_scalar": None, "attn_logit_softcapping": None,
                                    "final_logit_softcapping": None, "rope_local_theta": None}


_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True,
}
"""transformers' ``Gemma3TextConfig`` defaults: a multimodal Gemma 3's ``text_config`` lists only what differs."""


def text_part(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a multimodal Gemma 3 (``Gemma3ForConditionalGeneration``: tickloom runs its
    text part; ``arch.text_model_names`` finds its weights), else ``raw`` itself."""
    archs = raw.get("architectures") or []
    if not archs or archs[0] != "Gemma3ForConditionalGeneration":
        return raw
    text = {**_GEMMA3_TEXT_DEFAULTS, **(raw.get("text_config") or {})}
    for key in ("bos_token_id", "eos_token_id"):  # the model's, at the top
        if raw.get(key) is not None:
            text[key] = raw[key]
    return {**text, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}


def _family(raw: dict[str, Any], source: object) -> str:
    archs = raw.get("architectures") or []
    name = archs[0] if archs else None
    if name is None:
        mt = str(raw.get("model_type"))
        name = _CLASS_OF.get(_MODEL_TYPES.get(mt, ""), mt)
    if name not in SUPPORTED_ARCHITECTURES:
        supported = sorted([*SUPPORTED_ARCHITECTURES, "Gemma3ForConditionalGeneration (its text part)"])
        raise ModelLoadError(source, f"unsupported architecture {name!r}; supported: {supported}")
    return SUPPORTED_ARCHITECTURES[name]


def _rope_settings(family: str, raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float | None]:
    """(global base, global scaling or None, local base or None) from transformers 4's ``rope_theta`` /
    ``rope_scaling`` / ``rope_local_base_freq`` or 5's ``rope_parameters`` (flat, or per layer type for Gemma 3)."""
    params = raw.get("rope_parameters")
    local: dict[str, Any] = {}
    if isinstance(params, dict) and isinstance(params.get(FULL), dict):
        local = dict(params.get(SLIDING) or {})
        params = params[FULL]
    theta = raw.get("rope_theta")
    scaling = raw.get("rope_scaling")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling_kind(params) is not None:
            scaling = params
    theta = float(theta if theta is not None else 1_000_000.0 if family == "gemma3" else 10000.0)
    scaling = dict(scaling) if isinstance(scaling, dict) else None
    kind = scaling_kind(scaling)
    if kind is None:
        scaling = None
    elif kind not in SCALING_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: {list(SCALING_TYPES)}")
    elif kind == "longrope" and scaling is not None:
        half = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"])) // 2
        scaling = {**scaling, "rope_type": "longrope"}
        scaling.pop("type", None)
        scaling.setdefault("original_max_position_embeddings",
                           raw.get("original_max_position_embeddings", raw.get("max_position_embeddings", 4096)))
        for key in ("short_factor", "long_factor"):
            if len(scaling.get(key) or ()) != half:
                raise ValueError(f"longrope {key} must list {half} numbers (head_dim / 2)")
    if family != "gemma3":
        if local:
            raise ValueError("per-layer-type rope_parameters outside Gemma 3")
        return theta, scaling, None
    if scaling_kind(local) is not None:
        raise ValueError(f"rope scaling {scaling_kind(local)!r} on the sliding-window layers is not supported")
    local_theta = local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0))
    return theta, scaling, float(local_theta)


def _windows(family: str, raw: dict[str, Any], num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding window, per-layer types), with each family's transformers defaults for absent keys; no layer with
    a window gives (None, ())."""
    if family == "llama":
        return None, ()
    if family in ("qwen2", "qwen3"):
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
        after = int(raw.get("max_window_layers", 28))
        default = [SLIDING if i >= after else FULL for i in range(num_layers)]
    elif family in GEMMA:
        if raw.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=true (an embedding model) is not supported")
        window = raw.get("sliding_window", 4096)
        every = 2 if family == "gemma2" else int(raw.get("sliding_window_pattern", 6))
        default = [SLIDING if (i + 1) % every else FULL for i in range(num_layers)]
    else:  # mistral (4096 when absent, as transformers has it), phi3 (none when absent): every layer
        window = raw.get("sliding_window", 4096 if family == "mistral" else None)
        default = [SLIDING] * num_layers
    if window is None:
        return None, ()
    types = tuple(str(t) for t in (raw.get("layer_types") or default))
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"layer_types must list {num_layers} of {SLIDING!r} / {FULL!r}")
    if int(window) < 1:
        raise ValueError(f"sliding_window must be at least 1, got {window}")
    return (int(window), types) if SLIDING in types else (None, ())


def _optional_float(raw: dict[str, Any], key: str, default: float | None) -> float | None:
    value = raw.get(key, default)
    return None if value is None else float(value)


def _parse(cls: type[ModelConfig], family: str, raw: dict[str, Any], source: object) -> ModelConfig:
    act = raw.get("hidden_activation") if family in GEMMA and raw.get("hidden_activation") else None
    act = act or raw.get("hidden_act") or ("gelu_pytorch_tanh" if family in GEMMA else "silu")
    if act == "gelu_tanh":
        act = "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise ModelLoadError(source, f"unsupported hidden_act {act!r}; supported: {list(_ACTIVATIONS)}")
    if raw.get("mlp_bias"):
        raise ModelLoadError(source, "mlp_bias=true is not supported")
    rotary = raw.get("partial_rotary_factor", (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if rotary is not None and float(rotary) != 1.0:
        raise ModelLoadError(source, f"partial_rotary_factor={rotary} (rope on part of each head) is not supported")
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    layers = int(raw["num_hidden_layers"])
    eos_raw = raw.get("eos_token_id")
    eos: tuple[int, ...]
    if eos_raw is None:
        eos = ()
    elif isinstance(eos_raw, list):
        eos = tuple(int(e) for e in eos_raw)
    else:
        eos = (int(eos_raw),)
    try:
        theta, scaling, local_theta = _rope_settings(family, raw)
        window, types = _windows(family, raw, layers)
    except ValueError as exc:
        raise ModelLoadError(source, str(exc)) from exc
    gemma = family in GEMMA
    bos = raw.get("bos_token_id")
    return cls(
        architecture=family,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
        rope_scaling=scaling,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos,
        hidden_act=act,
        sliding_window=window,
        layer_types=types,
        query_pre_attn_scalar=_optional_float(raw, "query_pre_attn_scalar", 256.0) if gemma else None,
        attn_logit_softcapping=_optional_float(raw, "attn_logit_softcapping", 50.0 if family == "gemma2" else None)
        if gemma else None,
        final_logit_softcapping=_optional_float(raw, "final_logit_softcapping", 30.0 if family == "gemma2" else None)
        if gemma else None,
        rope_local_theta=local_theta,
    )


def rope_inv_freq(cfg: ModelConfig) -> list[float]:
    """Per-pair inverse frequencies of the global layers, with linear, Llama-3 or LongRoPE (short set) scaling."""
    return scaled_inv_freq(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling)
