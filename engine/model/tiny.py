"""Seeded random-weight tiny checkpoints (any family of ``config.SUPPORTED_ARCHITECTURES``, Hugging Face format)
for tests and benches."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tickloom.engine.model.arch import arch_options, expected_shapes
from tickloom.engine.model.checkpoint import write_checkpoint_files
from tickloom.engine.model.config import ModelConfig

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)


@dataclass(frozen=True, slots=True)
class TinySpec:
    architecture: str = "llama"  # a family: "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    options: tuple[tuple[str, Any], ...] = ()
    """Further ``ModelConfig`` fields (``sliding_window``, ``layer_types``, soft-caps, ...) over the family's
    defaults (``FAMILY_OPTIONS``)."""

    def config(self) -> ModelConfig:
        every = {"gemma2": 2, "gemma3": 6}.get(self.architecture)
        family: dict[str, Any] = dict(FAMILY_OPTIONS.get(self.architecture, {}))
        if every is not None:
            family["layer_types"] = tuple("sliding_attention" if (i + 1) % every else "full_attention"
                                          for i in range(self.num_layers))
        return ModelConfig(**{**self._base(), **family, **dict(self.options)})

    def _base(self) -> dict[str, Any]:
        return dict(
            architecture=self.architecture,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_heads,
            rms_norm_eps=1e-6,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.architecture == "qwen2",
            rope_scaling=self.rope_scaling,
            bos_token_id=0,
            eos_token_ids=(2,),
        )


FAMILY_OPTIONS: dict[str, dict[str, Any]] = {
    "gemma2": {"hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16.0, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "sliding_window": 8},
    "gemma3": {"hidden_act": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16.0, "sliding_window": 8,
               "rope_local_theta": 10000.0},
}
"""Each family's options as its real configs have them, windows sized for tiny sequences; Gemma's layers
alternate as in the real models (Gemma 2: every second layer global, Gemma 3: every sixth)."""


TINY_BENCH = TinySpec(
    vocab_size=32000, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=4
)
NAMED_TINY: dict[str, TinySpec] = {"tiny-bench": TINY_BENCH}


def tiny_tokenizer() -> tuple[Tokenizer, dict[str, Any]]:
    """A byte-level tokenizer (256 byte tokens after 3 specials, no merges) and its config."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    cfg = {
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[2],
        "chat_template": CHATML_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return tok, cfg


def random_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    offset = arch_options(cfg).norm_offset  # Gemma stores w - 1
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = 1.0 - offset + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            t = torch.randn(shape, generator=g, dtype=torch.float64) * (1.5 / shape[-1] ** 0.5)
        out[name] = t.to(dtype)
    return out


def write_tiny_model(
    out_dir: str | Path,
    spec: TinySpec | str = TinySpec(),
    seed: int = 0,
    dtype: str = "float32",
    **overrides: Any,
) -> Path:
    """Write a random-weight checkpoint (config.json, model.safetensors, tokenizer files)."""
    if isinstance(spec, str):
        spec = NAMED_TINY[spec]
    if overrides:
        spec = replace(spec, **overrides)
    cfg = spec.config()
    tdtype = {"float32": torch.float32, "float64": torch.float64}[dtype]
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    tok, tok_cfg = tiny_tokenizer()
    write_checkpoint_files(path, cfg, random_weights(cfg, seed, tdtype), tok, tok_cfg, torch_dtype=dtype)
    return path
