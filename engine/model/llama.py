"""Llama-family decoder over a paged KV cache (Llama, Llama-3 rope scaling, Qwen2 qkv bias, SmolLM2).

Plain torch in the gpt-fast style: a fused qkv weight, small functions, an explicit KV
cache. One forward runs a mixed batch of prefill chunks and decode rows, flattened to ``T`` tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from tickloom.engine.model.batch import AttnGroup, StepBatch
from tickloom.engine.model.config import ModelConfig, rope_inv_freq
from tickloom.engine.model.kv_cache import PagedKVCache
from tickloom.engine.model.quant import (
    Embedding,
    Linear,
    RawBlocks,
    Weight,
    activation_dtype,
    check_quant,
    head_quant,
    join_linear,
)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes this architecture needs."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
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
        out[p + "self_attn.q_proj.weight"] = (cfg.num_heads * d, h)
        out[p + "self_attn.k_proj.weight"] = (cfg.num_kv_heads * d, h)
        out[p + "self_attn.v_proj.weight"] = (cfg.num_kv_heads * d, h)
        out[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * d)
        if cfg.attention_bias:
            out[p + "self_attn.q_proj.bias"] = (cfg.num_heads * d,)
            out[p + "self_attn.k_proj.bias"] = (cfg.num_kv_heads * d,)
            out[p + "self_attn.v_proj.bias"] = (cfg.num_kv_heads * d,)
        out[p + "mlp.gate_proj.weight"] = (i, h)
        out[p + "mlp.up_proj.weight"] = (i, h)
        out[p + "mlp.down_proj.weight"] = (h, i)
    return out


class LayerWeights:
    """One decoder layer's weights, with q/k/v fused. Gate and up stay separate: on CPU two GEMMs
    beat one fused GEMM for prefill-sized inputs, and silu on a contiguous tensor is faster.

    Projections are ``Linear`` callables (``engine.model.quant``): dense, int8 or int4."""

    __slots__ = ("attn_norm", "mlp_norm", "qkv", "w1", "w2", "w3", "wo")

    def __init__(
        self, t: Mapping[str, Weight], prefix: str, bias: bool, quant: str, dtype: torch.dtype, act: torch.dtype
    ) -> None:
        a = prefix + "self_attn."
        self.attn_norm = _dense(t[prefix + "input_layernorm.weight"], dtype)
        self.mlp_norm = _dense(t[prefix + "post_attention_layernorm.weight"], dtype)
        biases = None
        if bias:
            biases = [_dense(t[a + f"{p}_proj.bias"], dtype) for p in "qkv"]
        self.qkv: Linear = join_linear([t[a + f"{p}_proj.weight"] for p in "qkv"], biases, quant, act)
        self.wo: Linear = join_linear([t[a + "o_proj.weight"]], None, quant, act)
        self.w1: Linear = join_linear([t[prefix + "mlp.gate_proj.weight"]], None, quant, act)
        self.w3: Linear = join_linear([t[prefix + "mlp.up_proj.weight"]], None, quant, act)
        self.w2: Linear = join_linear([t[prefix + "mlp.down_proj.weight"]], None, quant, act)


def _dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    return (w.dequantize() if isinstance(w, RawBlocks) else w).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    var = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on ``tokens x heads x head_dim``; ``cos``/``sin`` are ``tokens x 1 x dim/2``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaModel:
    """Weights plus the paged-attention forward. Not an ``nn.Module``: it never trains.

    ``quant`` (``engine.model.quant.QUANT_SETTINGS``) picks the projections' and the LM head's form; the
    embedding table stays in ``dtype`` for lookup (or GGUF Q8_0 rows, dequantized per lookup). Tensors may be
    GGUF ``RawBlocks``; float tensors are converted to ``dtype`` as they are used."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: Mapping[str, Weight],
        dtype: torch.dtype,
        device: torch.device,
        quant: str = "none",
    ) -> None:
        check_quant(quant, dtype, device)
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.quant = quant
        act = dtype if quant == "none" else activation_dtype(dtype)
        t: dict[str, Weight] = {
            k: v if isinstance(v, RawBlocks) else v.to(device=device, dtype=dtype if quant == "none" else v.dtype)
            for k, v in tensors.items()
        }
        self.embed = Embedding(t["model.embed_tokens.weight"], dtype)
        self.norm = _dense(t["model.norm.weight"], dtype)
        head = self.embed.weight() if cfg.tie_word_embeddings else t["lm_head.weight"]
        self.lm_head: Linear = join_linear([head], None, head_quant(quant), act)
        self.embed.raw = None  # the head has what it needed from the blocks
        self.layers = [
            LayerWeights(t, f"model.layers.{n}.", cfg.attention_bias, quant, dtype, act) for n in range(cfg.num_layers)
        ]
        self.scale = cfg.head_dim**-0.5
        inv = torch.tensor(rope_inv_freq(cfg), dtype=torch.float64)
        self._inv_freq = inv
        self._cos = torch.empty(0, device=device)
        self._sin = torch.empty(0, device=device)
        self._grow_rope(max(cfg.max_position_embeddings, 1))

    def _grow_rope(self, n: int) -> None:
        # positions x inv_freq in float32, as the reference implementation does
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), self._inv_freq.float())
        self._cos = freqs.cos().to(device=self.device, dtype=self.dtype)
        self._sin = freqs.sin().to(device=self.device, dtype=self.dtype)

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        c = self.cfg
        return PagedKVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: PagedKVCache) -> torch.Tensor:
        """Run all rows; return logits (float32) for ``batch.logit_index`` tokens, in that order."""
        max_pos = batch.max_position
        if max_pos >= self._cos.shape[0]:
            self._grow_rope(max(2 * self._cos.shape[0], max_pos + 1))
        cos = self._cos.index_select(0, batch.positions).unsqueeze(1)
        sin = self._sin.index_select(0, batch.positions).unsqueeze(1)
        x = self.embed(batch.input_ids)
        for n, layer in enumerate(self.layers):
            x = x + self._attention(n, layer, rms_norm(x, layer.attn_norm, self.cfg.rms_norm_eps), cos, sin, batch, kv)
            x = x + self._mlp(layer, rms_norm(x, layer.mlp_norm, self.cfg.rms_norm_eps))
        h = x if batch.logit_index is None else x.index_select(0, batch.logit_index)
        h = rms_norm(h, self.norm, self.cfg.rms_norm_eps)
        return self.lm_head(h).float()

    def weight_bytes(self) -> int:
        """Bytes of weights one forward reads (every projection and the head; the embedding rows are few)."""
        linears = [self.lm_head, *(p for ly in self.layers for p in (ly.qkv, ly.wo, ly.w1, ly.w2, ly.w3))]
        return sum(lin.nbytes() for lin in linears)

    def resident_bytes(self) -> int:
        """Bytes of all weights held (the head shares the embedding's storage when dense and tied)."""
        shared = self.cfg.tie_word_embeddings and self.quant == "none" and self.embed.table is not None
        return self.weight_bytes() + (0 if shared else self.embed.nbytes())

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate = F.silu(layer.w1(x))
        return layer.w2(gate.mul_(layer.w3(x)))

    def _attention(
        self,
        n: int,
        layer: LayerWeights,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: StepBatch,
        kv: PagedKVCache,
    ) -> torch.Tensor:
        c = self.cfg
        t = x.shape[0]
        qkv = layer.qkv(x)
        q = qkv[:, : c.q_size]
        k = qkv[:, c.q_size : c.q_size + c.kv_size]
        v = qkv[:, c.q_size + c.kv_size :]
        q = apply_rope(q.view(t, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(k.view(t, c.num_kv_heads, c.head_dim), cos, sin)
        kv.write(n, batch.write_slots, k, v.reshape(t, c.num_kv_heads, c.head_dim))
        if len(batch.groups) == 1 and batch.groups[0].token_index is None:
            out = self._attend(n, q, batch.groups[0], kv)
        else:
            out = torch.empty_like(q)
            for g in batch.groups:
                if g.token_index is None:
                    out[g.start : g.end] = self._attend(n, q[g.start : g.end], g, kv)
                else:
                    part = self._attend(n, q.index_select(0, g.token_index), g, kv)
                    out.index_copy_(0, g.token_index, part)
        return layer.wo(out.reshape(t, c.q_size))

    def _attend(self, n: int, q: torch.Tensor, g: AttnGroup, kv: PagedKVCache) -> torch.Tensor:
        """Attention for ``g.rows`` rows of ``g.q_len`` queries each over their gathered blocks.

        Grouped-query heads are folded into the query axis (head ``h`` uses kv head ``h // G``), so
        K/V are never repeated: queries become ``rows x kv_heads x (G * q_len) x head_dim``.
        """
        c = self.cfg
        groups = c.num_heads // c.num_kv_heads
        b, ql = g.rows, g.q_len
        kb, vb = kv.gather(n, g.block_index)
        ctx = kb.shape[0] // b * kv.block_size
        kk = kb.view(b, ctx, c.num_kv_heads, c.head_dim).transpose(1, 2)
        vv = vb.view(b, ctx, c.num_kv_heads, c.head_dim).transpose(1, 2)
        qq = q.view(b, ql, c.num_kv_heads, groups, c.head_dim).permute(0, 2, 3, 1, 4)
        qq = qq.reshape(b, c.num_kv_heads, groups * ql, c.head_dim)
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=g.mask, scale=self.scale)
        o = o.view(b, c.num_kv_heads, groups, ql, c.head_dim).permute(0, 3, 1, 2, 4)
        return o.reshape(b * ql, c.num_heads, c.head_dim)
