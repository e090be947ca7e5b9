"""What differs between the architectures tickloom runs, as options the forward reads (never family names).

``expected_shapes`` lists a family's checkpoint tensors; ``arch_options`` derives, from a ``ModelConfig``:

- the RMSNorm weight's offset (Gemma stores ``w - 1`` and multiplies by ``1 + w``), the MLP's activation
  (SiLU, or Gemma's tanh-approximated GELU) and the embedding's scale (Gemma: ``sqrt(hidden)``);
- per-head RMSNorm of queries and keys before rope (Qwen3, Gemma 3) and norms after attention and after the MLP
  too (Gemma 2 and 3: four norms a layer);
- the attention scale (Gemma: ``query_pre_attn_scalar ** -0.5``), tanh soft-capping of attention scores and of
  the final logits (Gemma 2);
- per layer, the sliding window (keys at positions ``> q - window`` only; Mistral, Phi-3, Gemma's local layers,
  Qwen with ``use_sliding_window``) and which rope it rotates by (Gemma 3's local layers have their own base);
- fused checkpoint projections (Phi-3's ``qkv_proj`` and ``gate_up_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from tickloom.engine.model.config import GEMMA, SLIDING, ModelConfig
from tickloom.engine.model.rope import Rope, make_rope

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ArchOptions:
    norm_offset: float
    gelu: bool
    """The MLP's activation: tanh-approximated GELU (else SiLU)."""
    embed_scale: float | None
    qk_norm: bool
    sandwich_norms: bool
    fused_projections: bool
    attn_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    layer_window: tuple[int | None, ...]
    layer_rope: tuple[int, ...]
    """Per layer, an index into ``ropes``."""
    ropes: tuple[Rope, ...]
    qkv_rows: int
    """Rows of the q, k and v projections together."""

    @property
    def plain(self) -> bool:
        """Llama's forward exactly (what the fused native kernels implement)."""
        return (self.norm_offset == 0.0 and not self.gelu and self.embed_scale is None and not self.qk_norm
                and not self.sandwich_norms and self.attn_softcap is None and self.final_softcap is None
                and all(w is None for w in self.layer_window) and len(self.ropes) == 1
                and self.ropes[0].long_inv_freq is None and self.ropes[0].scale == 1.0)


def arch_options(cfg: ModelConfig) -> ArchOptions:
    gemma = cfg.architecture in GEMMA
    sliding = [t == SLIDING for t in cfg.layer_types] or [False] * cfg.num_layers
    ropes = [make_rope(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling, cfg.max_position_embeddings)]
    if cfg.rope_local_theta is not None:
        ropes.append(make_rope(cfg.rope_local_theta, cfg.head_dim, None, cfg.max_position_embeddings))
    scalar = cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.head_dim
    return ArchOptions(
        norm_offset=1.0 if gemma else 0.0,
        gelu=cfg.hidden_act == "gelu_pytorch_tanh",
        embed_scale=cfg.hidden_size**0.5 if gemma else None,
        qk_norm=cfg.architecture in ("qwen3", "gemma3"),
        sandwich_norms=gemma,
        fused_projections=cfg.architecture == "phi3",
        attn_scale=float(scalar) ** -0.5,
        attn_softcap=cfg.attn_logit_softcapping,
        final_softcap=cfg.final_logit_softcapping,
        layer_window=tuple(cfg.sliding_window if s else None for s in sliding),
        layer_rope=tuple(1 if s and len(ropes) > 1 else 0 for s in sliding),
        ropes=tuple(ropes),
        qkv_rows=cfg.q_size + 2 * cfg.kv_size,
    )


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes this architecture needs."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    opts = arch_options(cfg)
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if opts.sandwich_norms:
            out[p + "pre_feedforward_layernorm.weight"] = (h,)
            out[p + "post_feedforward_layernorm.weight"] = (h,)
        if opts.fused_projections:
            out[p + "self_attn.qkv_proj.weight"] = (cfg.q_size + 2 * cfg.kv_size, h)
        else:
            out[p + "self_attn.q_proj.weight"] = (cfg.q_size, h)
            out[p + "self_attn.k_proj.weight"] = (cfg.kv_size, h)
            out[p + "self_attn.v_proj.weight"] = (cfg.kv_size, h)
        out[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
        if cfg.attention_bias:
            out[p + "self_attn.q_proj.bias"] = (cfg.q_size,)
            out[p + "self_attn.k_proj.bias"] = (cfg.kv_size,)
            out[p + "self_attn.v_proj.bias"] = (cfg.kv_size,)
        if opts.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        if opts.fused_projections:
            out[p + "mlp.gate_up_proj.weight"] = (2 * i, h)
        else:
            out[p + "mlp.gate_proj.weight"] = (i, h)
            out[p + "mlp.up_proj.weight"] = (i, h)
        out[p + "mlp.down_proj.weight"] = (h, i)
    return out


_TEXT_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                        ("language_model.lm_head.", "lm_head."))
"""A multimodal checkpoint's language model under the names a text-only one has (transformers 4 and 5 layouts)."""


def text_model_names(tensors: dict[str, T]) -> dict[str, T]:
    """``tensors`` with a multimodal model's language-model weights renamed as a text-only model's; others as
    they are (the vision tower's are not read)."""
    out: dict[str, T] = {}
    for name, t in tensors.items():
        for prefix, plain in _TEXT_MODEL_PREFIXES:
            if name.startswith(prefix):
                name = plain + name[len(prefix) :]
                break
        out[name] = t
    return out
