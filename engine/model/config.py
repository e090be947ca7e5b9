"""Model architecture configuration for the Llama family (Llama, Llama-3, Qwen2, SmolLM2)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tickloom.engine.model.errors import ModelLoadError

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the forward pass needs to know about the architecture."""

    architecture: str  # "llama" or "qwen2"
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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a Hugging Face checkpoint with this architecture would carry."""
        arch = "Qwen2ForCausalLM" if self.architecture == "qwen2" else "LlamaForCausalLM"
        eos: int | list[int] | None
        eos = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.architecture,
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
            "hidden_act": "silu",
            "rope_scaling": self.rope_scaling,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": "float32",
        }
        if self.architecture == "llama":
            out["attention_bias"] = self.attention_bias
            out["mlp_bias"] = False
        return out

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: object = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch_name = archs[0] if archs else None
        if arch_name is None:
            mt = raw.get("model_type")
            arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(str(mt), str(mt))
        if arch_name not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                source,
                f"unsupported architecture {arch_name!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}",
            )
        family = SUPPORTED_ARCHITECTURES[arch_name]
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(source, f"unsupported hidden_act {act!r} (only 'silu')")
        if raw.get("mlp_bias"):
            raise ModelLoadError(source, "mlp_bias=true is not supported")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            head_dim = int(raw.get("head_dim") or hidden // heads)
            eos_raw = raw.get("eos_token_id")
            eos: tuple[int, ...]
            if eos_raw is None:
                eos = ()
            elif isinstance(eos_raw, list):
                eos = tuple(int(e) for e in eos_raw)
            else:
                eos = (int(eos_raw),)
            rope_params = raw.get("rope_parameters")  # transformers >= 5 spelling
            rope_scaling = raw.get("rope_scaling")
            rope_theta = raw.get("rope_theta")
            if isinstance(rope_params, dict):
                rope_theta = rope_params.get("rope_theta", rope_theta)
                if rope_params.get("rope_type", "default") != "default":
                    rope_scaling = rope_params
            if rope_scaling is not None:
                kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
                if kind in (None, "default"):
                    rope_scaling = None
                elif kind not in ("llama3", "linear"):
                    raise ModelLoadError(source, f"unsupported rope scaling type {kind!r}")
            bos = raw.get("bos_token_id")
            return cls(
                architecture=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
                rope_scaling=dict(rope_scaling) if rope_scaling else None,
                bos_token_id=int(bos) if bos is not None else None,
                eos_token_ids=eos,
            )
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


def rope_inv_freq(cfg: ModelConfig) -> list[float]:
    """Per-pair inverse frequencies, including Llama-3 and linear rope scaling."""
    dim = cfg.head_dim
    base = [1.0 / (cfg.rope_theta ** (i / dim)) for i in range(0, dim, 2)]
    sc = cfg.rope_scaling
    if not sc:
        return base
    kind = sc.get("rope_type", sc.get("type"))
    factor = float(sc.get("factor", 1.0))
    if kind == "linear":
        return [f / factor for f in base]
    low = float(sc.get("low_freq_factor", 1.0))
    high = float(sc.get("high_freq_factor", 4.0))
    old_ctx = float(sc.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    out: list[float] = []
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen > low_wavelen:
            out.append(f / factor)
        elif wavelen < high_wavelen:
            out.append(f)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out
