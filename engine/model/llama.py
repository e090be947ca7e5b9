"""The decoder over a paged KV cache, for every family ``engine.model.arch`` describes (Llama, Mistral, Qwen2/3,
Gemma 2/3, Phi-3): the forward reads the architecture's options (``ArchOptions``), never its name.

Plain torch in the gpt-fast style: a fused qkv weight, small functions, an explicit KV
cache. One forward runs a mixed batch of prefill chunks and decode rows, flattened to ``T`` tokens.

At batch 1 a small model's step is mostly per-op overhead (30 layers of a dozen small ops each), so each layer
keeps the op count down: one fused RMSNorm, rope on q and k at once written back into the qkv output, K and V
stored by one ``index_copy_`` and gathered by one ``index_select`` (``kv_cache.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from tickloom.engine.model import native
from tickloom.engine.model.arch import ArchOptions, arch_options, expected_shapes
from tickloom.engine.model.batch import AttnGroup, StepBatch
from tickloom.engine.model.config import ModelConfig
from tickloom.engine.model.embedding import Embedding
from tickloom.engine.model.fused import FusedLayers
from tickloom.engine.model.head import head_linear
from tickloom.engine.model.kv_cache import PagedKVCache
from tickloom.engine.model.quant import (
    DenseLinear,
    Int4Linear,
    Linear,
    RawBlocks,
    Weight,
    activation_dtype,
    check_quant,
    join_linear,
)
from tickloom.engine.model.quant_grouped import SplitLinear, WideIntLinear
from tickloom.engine.model.rope import rope_tables as rope_kind_tables

__all__ = ["LayerWeights", "LlamaModel", "apply_rope", "expected_shapes", "norm_weight2", "rms_norm", "rope_tables"]

_QUERY_SLICE = 64
"""Queries per kernel call in ``_attend_each_query`` (its scratch grows with queries x context)."""


class LayerWeights:
    """One decoder layer's weights, with q/k/v fused and gate/up fused (``w13``: rows ``[gate; up]``).

    Projections are ``Linear`` callables (``engine.model.quant``): dense, int8 or int4. Norm weights are in the
    form the model's norm takes (``LlamaModel._norm_weight``); ``mlp_norm`` is the norm before the MLP (Gemma's
    ``pre_feedforward_layernorm``, whose ``post_attention_layernorm`` is ``post_attn_norm``, after attention)."""

    __slots__ = ("attn_norm", "k_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "q_norm", "qkv", "w2", "w13",
                 "wo")

    def __init__(self, t: Mapping[str, Weight], prefix: str, bias: bool, quant: str, dtype: torch.dtype,
                 act: torch.dtype, norm_weight: Callable[[torch.Tensor], torch.Tensor],
                 opts: ArchOptions | None = None) -> None:
        a = prefix + "self_attn."
        sandwich = opts is not None and opts.sandwich_norms

        def norm(name: str) -> torch.Tensor:
            return norm_weight(_dense(t[prefix + name], dtype))

        self.attn_norm = norm("input_layernorm.weight")
        self.mlp_norm = norm("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight")
        self.post_attn_norm = norm("post_attention_layernorm.weight") if sandwich else None
        self.post_mlp_norm = norm("post_feedforward_layernorm.weight") if sandwich else None
        qk_norm = opts is not None and opts.qk_norm
        self.q_norm = norm("self_attn.q_norm.weight") if qk_norm else None
        self.k_norm = norm("self_attn.k_norm.weight") if qk_norm else None
        biases = None
        if bias:
            biases = [_dense(t[a + f"{p}_proj.bias"], dtype) for p in "qkv"]
        fused = opts is not None and opts.fused_projections
        qkv = [t[a + "qkv_proj.weight"]] if fused else [t[a + f"{p}_proj.weight"] for p in "qkv"]
        if fused and opts is not None and qkv[0].shape[0] != opts.qkv_rows:
            # a model of part of the heads (tensor parallelism) cannot take the whole fused projection
            raise ValueError(f"{a}qkv_proj.weight has {qkv[0].shape[0]} rows, this model's heads take "
                             f"{opts.qkv_rows}: fused projections cannot be split over ranks")
        self.qkv: Linear = join_linear(qkv, biases, quant, act)
        self.wo: Linear = join_linear([t[a + "o_proj.weight"]], None, quant, act)
        m = prefix + "mlp."
        w13 = [t[m + "gate_up_proj.weight"]] if fused else [t[m + "gate_proj.weight"], t[m + "up_proj.weight"]]
        self.w13: Linear = join_linear(w13, None, quant, act)
        self.w2: Linear = join_linear([t[m + "down_proj.weight"]], None, quant, act)
        for proj in (self.qkv, self.wo, self.w13, self.w2):
            # a split projection (a Q4_K_M file's q/k beside a v of another type) is its parts on the kernels
            for part in proj.parts if isinstance(proj, SplitLinear) else [proj]:
                if isinstance(part, (Int4Linear, WideIntLinear)):
                    # two 8-bit passes of the input on tickloom's integer kernels, where a group's step is far
                    # above its row's others (cpu_kernels_common.h says what this buys and costs)
                    part.passes = 2


def _dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    return (w.dequantize() if isinstance(w, RawBlocks) else w).to(dtype)


def rms_norm(x: torch.Tensor, weight2: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` (``tokens x hidden``) with ``weight2 = norm_weight2(weight)``.

    Why layer_norm: torch's CPU ``rms_norm`` is a composite of seven ops, while ``layer_norm`` is one fused kernel
    (float32 statistics for 16-bit inputs). Over ``[x, -x]`` the mean is zero and the variance is ``mean(x^2)``,
    so its first half is exactly RMSNorm, for half the time at batch 1. The result is a view (contiguous for one
    token)."""
    h = x.shape[-1]
    return F.layer_norm(torch.cat((x, x.neg()), -1), (2 * h,), weight2, None, eps)[..., :h]


def norm_weight2(w: torch.Tensor) -> torch.Tensor:
    """An RMSNorm weight padded with zeros to the width ``rms_norm`` normalizes."""
    return torch.cat((w, torch.zeros_like(w)))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on ``tokens x heads x head_dim``, in place; ``cos`` is ``tokens x 1 x dim`` (the angles
    twice), ``sin`` the same with its first half negated (``rope_tables``).

    ``rotate_half(x) * sin == x.roll(dim / 2) * sin_signed``, so rope is three ops and needs no ``cat``."""
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, x.roll(half, -1), sin, out=x)


def rope_tables(inv_freq: torch.Tensor, n: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin), each ``n x head_dim``, for positions ``0..n-1``. The angles are computed in float32, as the
    reference implementation does."""
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq.float())
    cos, sin = freqs.cos(), freqs.sin()
    return (torch.cat((cos, cos), -1).to(device=device, dtype=dtype),
            torch.cat((-sin, sin), -1).to(device=device, dtype=dtype))


class LlamaModel:
    """Weights plus the paged-attention forward. Not an ``nn.Module``: it never trains.

    ``quant`` (``engine.model.quant.QUANT_SETTINGS``) picks the projections' form; the LM head is dense without
    ``quant`` and int8 with it (``head.head_linear``). The embedding table stays in ``dtype`` for lookup (or GGUF
    Q8_0 rows, dequantized per lookup). Tensors may be GGUF ``RawBlocks``; float tensors are converted to ``dtype``
    as they are used. What the architecture adds to Llama's forward is ``self.opts`` (``arch.ArchOptions``)."""

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
        self.opts = opts = arch_options(cfg)
        self.dtype = dtype
        self.device = device
        self.quant = quant
        act = dtype if quant == "none" else activation_dtype(dtype)
        t: dict[str, Weight] = {
            k: v if isinstance(v, RawBlocks) else v.to(device=device, dtype=dtype if quant == "none" else v.dtype)
            for k, v in tensors.items()
        }
        # tickloom's fused CPU kernels (engine.model.native) for the row-wise ops and decode attention; they
        # implement Llama's forward only (no windows, soft-caps, extra norms or norm offsets), for a bfloat16 model
        # (bfloat16 activations, float32 residual stream) or a float32 one with float32 weights or 16-bit ones on
        # the kernels (an F16 or BF16 file: float32 throughout)
        self._native = (opts.plain and (dtype == torch.bfloat16 or (dtype == torch.float32 and quant == "none"))
                        and device.type == "cpu" and cfg.head_dim % 32 == 0 and cfg.head_dim <= 256
                        and cfg.hidden_size % 16 == 0 and cfg.intermediate_size % 16 == 0 and native.available())
        self.embed = Embedding(t["model.embed_tokens.weight"], dtype)
        self.norm = self._norm_weight(_dense(t["model.norm.weight"], dtype))
        head = self.embed.weight() if cfg.tie_word_embeddings else t["lm_head.weight"]
        # The head packs on a second thread while the layers pack here: fbgemm's packing of the 49152-row head
        # (0.3 s) releases the GIL, and most of the layers' packing does too.
        with ThreadPoolExecutor(max_workers=1) as pool:
            pending = pool.submit(head_linear, head, quant, act)
            self.layers = [
                LayerWeights(t, f"model.layers.{n}.", cfg.attention_bias, quant, dtype, act, self._norm_weight, opts)
                for n in range(cfg.num_layers)
            ]
            self.lm_head: Linear = pending.result()
        self.embed.release_pages()  # packing read every page of the file; lookups need a few rows
        if cfg.tie_word_embeddings:
            self.embed.read_rows_from(self.lm_head)
        self.scale = opts.attn_scale
        self._q_size, self._kv_size, self._gqa = cfg.q_size, cfg.kv_size, cfg.num_heads // cfg.num_kv_heads
        self._rope_heads, self._kv_heads2 = cfg.num_heads + cfg.num_kv_heads, 2 * cfg.num_kv_heads
        self._ropes: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._grow_rope(max(min(cfg.max_position_embeddings, 2048), 1))
        # every layer in one kernel call where the kernels take them all (fused.py); None keeps the loop below
        self._fused = FusedLayers.build(self) if self._native else None

    @property
    def _cos(self) -> torch.Tensor:
        return self._ropes[0][0]

    @property
    def _sin(self) -> torch.Tensor:
        return self._ropes[0][1]

    def _grow_rope(self, n: int) -> None:
        self._ropes = [rope_kind_tables(r, n, self.dtype, self.device) for r in self.opts.ropes]

    def new_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        c = self.cfg
        return PagedKVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: PagedKVCache) -> torch.Tensor:
        """Run all rows; return logits (float32) for ``batch.logit_index`` tokens, in that order."""
        opts = self.opts
        max_pos = batch.max_position
        if max_pos >= self._cos.shape[0]:
            self._grow_rope(max(2 * self._cos.shape[0], max_pos + 1))
        x = self.embed(batch.input_ids)
        if self._native:
            x = x.float()  # the residual stream (see ``_project``)
        if opts.embed_scale is not None:
            # the scale rounded to the activations' dtype first, as the reference does
            x.mul_(torch.tensor(opts.embed_scale, dtype=x.dtype))
        # the last sublayer's output, not yet added to the residual stream x
        y: torch.Tensor | None
        if self._fused is not None:
            y = self._fused.run(x, batch, kv, self._cos, self._sin, self.cfg.rms_norm_eps, self.scale)
        else:
            y = self._layer_loop(x, batch, kv)
        if y is not None:
            x.add_(y)
        h = x if batch.logit_index is None else x.index_select(0, batch.logit_index)
        logits = self.lm_head(self._add_norm(h, None, self.norm)).float()
        if opts.final_softcap is not None:
            logits = _softcap(logits, opts.final_softcap)
        return logits

    def _layer_loop(self, x: torch.Tensor, batch: StepBatch, kv: PagedKVCache) -> torch.Tensor | None:
        """The layers one by one on the residual stream ``x``; returns the last sublayer's output, not yet added to
        ``x`` (None for a model of no layers)."""
        opts = self.opts
        ropes = [None if self._native else (cos.index_select(0, batch.positions).unsqueeze(1),
                                            sin.index_select(0, batch.positions).unsqueeze(1))
                 for cos, sin in self._ropes]
        masks = {w: self._step_masks(batch, w) for w in set(opts.layer_window)}
        y: torch.Tensor | None = None
        for n, layer in enumerate(self.layers):
            y = self._attention(n, layer, self._add_norm(x, y, layer.attn_norm), ropes[opts.layer_rope[n]], batch,
                                masks[opts.layer_window[n]], kv)
            if layer.post_attn_norm is not None:
                y = rms_norm(y, layer.post_attn_norm, self.cfg.rms_norm_eps)
            y = self._project(layer.w2, self._act_mul(layer.w13(self._add_norm(x, y, layer.mlp_norm))))
            if layer.post_mlp_norm is not None:
                y = rms_norm(y, layer.post_mlp_norm, self.cfg.rms_norm_eps)
        return y

    def layers_changed(self) -> None:
        """Say that a layer's projections were replaced after the model was built (``tp.py`` wraps o and down):
        the fused tables point at the old ones, so they are built again, or dropped for what they cannot run."""
        self._fused = FusedLayers.build(self) if self._native else None

    def _step_masks(self, batch: StepBatch, window: int | None) -> list[torch.Tensor]:
        """Each group's mask for layers with ``window`` (None: causal only); a batched decode group's as an
        additive bias (``_decode_bias``). A window adds ``key position > query position - window`` to the causal
        mask: the gathered context's index is the key's position, and the queries' positions are each decode row's
        last one (``lengths - 1``) or a prefill chunk's ``batch.positions``."""
        out: list[torch.Tensor] = []
        for g in batch.groups:
            mask = g.mask
            if window is not None:
                keys = torch.arange(mask.shape[-1], device=mask.device)
                if g.q_len == 1 and g.lengths is not None:
                    q_pos = (g.lengths - 1).view(-1, 1, 1, 1)
                elif g.rows == 1:
                    pos = (batch.positions[g.start : g.end] if g.token_index is None
                           else batch.positions.index_select(0, g.token_index))
                    q_pos = pos.repeat(self._gqa).view(1, 1, -1, 1)
                else:
                    raise NotImplementedError(f"sliding windows over a group of {g.rows} rows of {g.q_len} queries")
                mask = mask & (keys > q_pos - window)
            out.append(self._decode_bias(mask, g.rows) if g.q_len == 1 and g.rows > 1 and not self._native
                       else mask)
        return out

    def _norm_weight(self, w: torch.Tensor) -> torch.Tensor:
        if self.opts.norm_offset:
            w = w + self.opts.norm_offset
        return w.float().contiguous() if self._native else norm_weight2(w)

    def _add_norm(self, x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """``x += add`` (when given), then RMSNorm of ``x``."""
        eps = self.cfg.rms_norm_eps
        if self._native:
            return native.add_rms_norm(x, add, weight, eps, self.dtype)
        if add is not None:
            x.add_(add)
        return rms_norm(x, weight, eps)

    def _project(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        """A projection whose output is added to the residual stream (o, down). On tickloom's kernels the stream is
        float32 and so are these outputs: rounding each sublayer's contribution, and the running sum, to bfloat16
        cost about a point of top-1 agreement with float32 activations (``tickloom bench model --accuracy``), for a
        few hundred bytes a row. The other paths keep their dtype throughout."""
        if not self._native:
            return linear(x)
        as_f32 = getattr(linear, "forward_f32", None)
        return as_f32(x) if as_f32 is not None else linear(x).float()

    def _act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up`` of the fused gate/up projection's output."""
        if self._native:
            return native.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.opts.gelu:
            return F.gelu(gate, approximate="tanh").mul_(up)
        return F.silu(gate).mul_(up)

    def weight_bytes(self) -> int:
        """Bytes of weights one forward reads (every projection and the head; the embedding rows are few)."""
        linears = [self.lm_head, *(p for ly in self.layers for p in (ly.qkv, ly.wo, ly.w13, ly.w2))]
        return sum(lin.nbytes() for lin in linears)

    def resident_bytes(self) -> int:
        """Bytes of all weights held (the head shares the embedding's storage when dense and tied)."""
        # a dense head of tied weights is the embedding's tensor; a bfloat16 model's head on the kernels is a copy
        shared = (self.cfg.tie_word_embeddings and isinstance(self.lm_head, DenseLinear)
                  and self.embed.table is not None)
        return self.weight_bytes() + (0 if shared else self.embed.nbytes())

    def _decode_bias(self, mask: torch.Tensor, rows: int) -> torch.Tensor:
        """A decode group's mask as an additive bias, ``1 x rows x 1 x ctx``, made once per step for all layers."""
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(~mask, float("-inf"))
        return bias.view(1, rows, 1, -1)

    def _attention(
        self,
        n: int,
        layer: LayerWeights,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        batch: StepBatch,
        masks: list[torch.Tensor],
        kv: PagedKVCache,
    ) -> torch.Tensor:
        t = x.shape[0]
        qs, d = self._q_size, self.cfg.head_dim
        qkv = layer.qkv(x)
        if layer.q_norm is not None and layer.k_norm is not None:  # per head, before rope
            heads = self.cfg.num_heads
            qk = qkv[:, : qs + self._kv_size].view(t, self._rope_heads, d)
            eps = self.cfg.rms_norm_eps
            qk[:, :heads] = rms_norm(qk[:, :heads], layer.q_norm, eps)
            qk[:, heads:] = rms_norm(qk[:, heads:], layer.k_norm, eps)
        if rope is None:
            native.rope_and_store(qkv, batch.positions, self._cos, self._sin, self._rope_heads,
                                  self.cfg.num_kv_heads, batch.write_slots, kv.kv[n])
        else:
            apply_rope(qkv[:, : qs + self._kv_size].view(t, self._rope_heads, d), *rope)
            kv.write(n, batch.write_slots, qkv[:, qs:].view(t, self._kv_heads2, d))
        q = qkv[:, :qs]
        groups = batch.groups
        if len(groups) == 1 and groups[0].token_index is None:
            return self._project(layer.wo, self._attend(n, q, groups[0], masks[0], kv))
        out = torch.empty(t, qs, dtype=qkv.dtype, device=qkv.device)
        for g, mask in zip(groups, masks, strict=True):
            if g.token_index is None:
                out[g.start : g.end] = self._attend(n, q[g.start : g.end], g, mask, kv)
            else:
                out.index_copy_(0, g.token_index, self._attend(n, q.index_select(0, g.token_index), g, mask, kv))
        return self._project(layer.wo, out)

    def _attend_each_query(self, n: int, q: torch.Tensor, g: AttnGroup, kv: PagedKVCache) -> torch.Tensor:
        """A prefill chunk's (or a catch-up row's) attention on the kernels, each query as a decode row of its own.

        Why not torch's flash attention, as the float paths use: its blocking depends on the chunk's length, and in
        bfloat16 a query's result moved with it, enough to change a token: a prompt prefilled whole and the same
        prompt split into chunks by a busier step's token budget decoded differently (a request's tokens then
        depended on its batch). Each query alone is a function of its position and the cache only, so chunking,
        batching and running ahead cannot change it. It does not reuse keys across queries as flash attention does
        (prefill took about 12% longer for it, on prompts of 64 and 512 tokens); queries go in slices so that the
        scratch stays small."""
        assert g.lengths is not None
        if g.query_tables is None:
            g.query_tables = g.block_index.repeat(min(g.q_len, _QUERY_SLICE))
        out = []
        for at in range(0, g.q_len, _QUERY_SLICE):
            lengths = g.lengths[at : at + _QUERY_SLICE]
            tables = g.query_tables[: lengths.numel() * g.block_index.numel()]
            out.append(native.decode_attention(q[at : at + _QUERY_SLICE], kv.kv[n], tables, lengths, self._gqa,
                                               self.scale))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _attend(self, n: int, q: torch.Tensor, g: AttnGroup, mask: torch.Tensor, kv: PagedKVCache) -> torch.Tensor:
        """Attention for ``g.rows`` rows of ``g.q_len`` queries each over their gathered blocks; returns
        ``rows * q_len x q_size``.

        Grouped-query heads are folded into the query axis (head ``h`` uses kv head ``h // G``), so K/V are never
        repeated, and kv heads lead (the gathered cache's order): queries become ``kv_heads x rows x (G * q_len) x
        head_dim``. Batched decode rows use two matmuls and a softmax: torch's CPU flash attention runs per (row,
        head) and cost 3x that at batch 32; a single row or a prefill chunk uses it (unless scores are
        soft-capped, which it cannot do)."""
        kvh, groups, d = self.cfg.num_kv_heads, self._gqa, self.cfg.head_dim
        b, ql = g.rows, g.q_len
        if self._native and g.lengths is not None:
            if ql == 1:
                return native.decode_attention(q, kv.kv[n], g.block_index, g.lengths, groups, self.scale)
            return self._attend_each_query(n, q, g, kv)
        kb, vb = kv.gather(n, g.block_index)
        k, v = kb.view(kvh, b, -1, d), vb.view(kvh, b, -1, d)
        cap = self.opts.attn_softcap
        if ql == 1 and b == 1 and cap is None:  # one token: rows x kv_heads and kv_heads x rows are the same memory
            o = F.scaled_dot_product_attention(q.view(kvh, 1, groups, d), k, v, attn_mask=mask, scale=self.scale)
            return o.view(1, self._q_size)
        if ql == 1:
            qq = q.view(b, kvh, groups, d).transpose(0, 1)
            if cap is None:
                scores = torch.add(mask, torch.matmul(qq, k.transpose(-1, -2)), alpha=self.scale)
            else:
                scores = _masked(_softcap(torch.matmul(qq, k.transpose(-1, -2)).mul_(self.scale), cap), mask)
            o = torch.matmul(scores.softmax(-1), v)
            return o.transpose(0, 1).reshape(b, self._q_size)
        qq = q.view(ql, kvh, groups, d).permute(1, 2, 0, 3).reshape(kvh, 1, groups * ql, d)
        if cap is None:
            o = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=self.scale)
        else:
            scores = _softcap(torch.matmul(qq, k.transpose(-1, -2)).mul_(self.scale), cap)
            o = torch.matmul(_masked(scores, mask).softmax(-1), v)
        return o.view(kvh, groups, ql, d).permute(2, 0, 1, 3).reshape(ql, self._q_size)


def _softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: scores or logits squashed smoothly into ``(-cap, cap)`` (Gemma 2)."""
    return torch.tanh(x / cap).mul_(cap)


def _masked(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scores with masked-out keys at -inf; ``mask`` is a bool mask (True = attend) or an additive bias."""
    return scores.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else scores.add_(mask)
