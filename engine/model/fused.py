"""A step's decoder layers in one call to tickloom's kernels (``cpu_kernels_layers.h``), for the models whose every
layer they take: the same kernels ``LlamaModel``'s layer loop calls, in the same order, so the logits are the
loop's to the bit (``tests/test_fused_layers.py``).

Why: at batch 1 the loop's Python was a third of a small model's step (14 kernel calls a layer, each about 2 us of
ctypes and as much again of wrapper). The layer loop stays for everything else: biases on o or down, o or down
split over kernels, extra norms, gelu, windows, soft-caps, dense float32 weights.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from tickloom.engine.model import native
from tickloom.engine.model.batch import StepBatch
from tickloom.engine.model.kv_cache import PagedKVCache
from tickloom.engine.model.quant import Int4Linear
from tickloom.engine.model.quant_grouped import GroupedInt8Linear, HalfLinear, SplitLinear, WideIntLinear

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
LIN_Q8, LIN_HALF, LIN_BF16 = 8, {"BF16": 16, "F16": 17}, 18
"""Projection kinds (``cpu_kernels_layers.h``'s LIN_*); 4-, 5- and 6-bit tiles are their bit count."""


class _Linear(ctypes.Structure):
    _fields_ = [("w", _ptr), ("n", _i64), ("k", _i64), ("kind", _i64), ("passes", _i64)]


_PARTS = 3


class _Proj(ctypes.Structure):
    _fields_ = [("part", _Linear * _PARTS), ("bias", _ptr), ("bias_after", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Proj), ("wo", _Proj), ("w13", _Proj), ("w2", _Proj), ("attn_norm", _ptr), ("mlp_norm", _ptr)]


class _Model(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("hidden", "inter", "q_size", "qkv_size", "rope_heads", "kv_heads", "groups",
                                          "head_dim", "f32")]


def _kind(linear: Any, act: torch.dtype, has_bf16: bool) -> int | None:
    """The kernel kind that computes ``linear`` (bias aside) as its class does, or None where none does (a split
    projection, dense weights, Q8 offsets, a width the bfloat16 rounding loop does not take)."""
    if linear.out_features % 16:
        return None
    if isinstance(linear, Int4Linear) and linear.tiles is not None and act == torch.bfloat16:
        return 4
    if isinstance(linear, WideIntLinear) and act == torch.bfloat16:
        return linear.bits
    if isinstance(linear, GroupedInt8Linear) and linear.tiles is not None and linear.z is None:
        return LIN_Q8 if act == torch.bfloat16 else None
    if isinstance(linear, HalfLinear):
        if act == torch.float32:
            return LIN_HALF[linear.kind]
        return LIN_BF16 if linear.kind == "BF16" and has_bf16 else None
    return None


def _proj(linear: Any, act: torch.dtype, has_bf16: bool, rounded: bool, keep: list[torch.Tensor]) -> _Proj | None:
    """``linear``'s parts and bias as ``run_layers`` reads them (the bias's float32 copy goes to ``keep``). A
    ``SplitLinear`` joins its parts' rounded outputs, and a layer with a bias adds it to its rounded output, which is
    what the loop adds to the residual stream for o and down, not their float32 sums: there it stays."""
    split = isinstance(linear, SplitLinear)
    parts: list[Any] = list(linear.parts) if split else [linear]
    bias = getattr(linear, "bias", None)  # (a wrapper of tp.py's has none: it is refused below)
    if len(parts) > _PARTS or ((split or bias is not None) and not rounded):
        return None
    proj = _Proj()
    if bias is not None:
        # where each class adds it: a split layer and the integer layers to their rounded output (the split
        # layer's rounded to the activations' dtype first), the 16-bit layers to the float32 sums
        after = not isinstance(linear, HalfLinear)
        held = (bias.to(act) if split else bias).float().contiguous()
        keep.append(held)
        proj.bias, proj.bias_after = held.data_ptr(), int(after)
    for i, part in enumerate(parts):
        kind = _kind(part, act, has_bf16)
        if kind is None or (split and part.bias is not None):
            return None
        tiles = part.tiles
        address = tiles.data_ptr() if isinstance(tiles, torch.Tensor) else tiles.ctypes.data
        passes = part.passes if kind in (4, 5, 6) else 1
        proj.part[i] = _Linear(address, part.out_features, part.in_features, kind, passes)
    return proj


class FusedLayers:
    """The tables ``run_layers`` reads (each layer's weights' addresses and kinds), built once for a model, and the
    per-step call. ``build`` returns None for a model it cannot run; the model then keeps its loop."""

    def __init__(self, model: _Model, layers: Any, keep: list[torch.Tensor], kernel: Any) -> None:
        self._model, self._layers, self._count = model, layers, len(layers)
        self._keep = keep  # the norm weights and biases the tables point into
        self._run, self._work_bytes = kernel.run_layers, kernel.layers_work_bytes

    @classmethod
    def build(cls, model: Any) -> FusedLayers | None:
        """``model``: a ``LlamaModel`` on tickloom's kernels (``model._native``)."""
        opts, cfg = model.opts, model.cfg
        if (not model._native or len(opts.ropes) != 1 or opts.gelu or opts.attn_softcap is not None
                or set(opts.layer_window) != {None} or opts.norm_offset):
            return None
        kernel = native._kernel()
        act = model.dtype
        has_bf16 = kernel.bf16_matmul is not None
        layers = (_Layer * len(model.layers))()
        keep: list[torch.Tensor] = []
        for spec, layer in zip(layers, model.layers, strict=True):
            if (layer.q_norm is not None or layer.post_attn_norm is not None or layer.post_mlp_norm is not None):
                return None
            for name in ("qkv", "wo", "w13", "w2"):
                proj = _proj(getattr(layer, name), act, has_bf16, name in ("qkv", "w13"), keep)
                if proj is None:
                    return None
                setattr(spec, name, proj)
            for name in ("attn_norm", "mlp_norm"):
                weight = getattr(layer, name)
                if weight.dtype != torch.float32 or not weight.is_contiguous():
                    return None
                keep.append(weight)
                setattr(spec, name, weight.data_ptr())
        sizes = _Model(cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.q_size + 2 * cfg.kv_size,
                       cfg.num_heads + cfg.num_kv_heads, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads,
                       cfg.head_dim, int(act == torch.float32))
        return cls(sizes, layers, keep, kernel)

    def run(self, x: torch.Tensor, batch: StepBatch, kv: PagedKVCache, cos: torch.Tensor, sin: torch.Tensor,
            eps: float, scale: float) -> torch.Tensor:
        """Every layer on ``x`` (``tokens x hidden`` float32, the embeddings; it becomes the residual stream):
        returns the last layer's down projection, not yet added to ``x`` (the loop's ``y``)."""
        rows = x.shape[0]
        layer = kv.kv[0]
        if (layer.dtype != x.dtype if self._model.f32 else layer.dtype != torch.bfloat16) or (
                self._count > 1 and kv.kv[1].data_ptr() - layer.data_ptr() != layer.numel() * layer.element_size()):
            raise ValueError(f"run_layers: wants the cache's layers one after another in the activations' dtype "
                             f"({layer.dtype}, {x.dtype} activations)")
        tables, lengths = token_tables(batch, rows)
        per_row = tables.shape[1]
        y = torch.empty_like(x)
        work = native._scratch_at_least(self._work_bytes(ctypes.byref(self._model), self._layers, self._count, rows,
                                                         per_row * kv.block_size) + 64)
        rc = self._run(ctypes.byref(self._model), self._layers, self._count, x.data_ptr(), y.data_ptr(), rows,
                       batch.positions.data_ptr(), batch.write_slots.data_ptr(), tables.data_ptr(), per_row,
                       lengths.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv.kv[0].data_ptr(), kv.num_blocks,
                       kv.block_size, eps, scale, (work + 63) & ~63, torch.get_num_threads())
        if rc:
            raise ValueError(f"run_layers: a kernel refused the step (rc {rc}): a context length outside its block "
                             f"table, or a shape the kernels do not take")
        return y


def token_tables(batch: StepBatch, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's block table (``rows x per_row`` int64, short tables padded with block 0, which a row never
    reads past its length) and context length (``rows`` int64): a decode row's own, or for a prompt query its
    chunk's table and its position + 1. One decode group in token order (a decode step) is its tensors as they
    are."""
    groups = batch.groups
    g = groups[0]
    if len(groups) == 1 and g.q_len == 1 and g.token_index is None and g.lengths is not None:
        return g.block_index.view(g.rows, -1), g.lengths
    per_row = max(gr.block_index.numel() // gr.rows for gr in groups)
    tables = torch.zeros(rows, per_row, dtype=torch.int64)
    lengths = torch.empty(rows, dtype=torch.int64)
    for gr in groups:
        assert gr.lengths is not None
        width = gr.block_index.numel() // gr.rows
        table = gr.block_index.view(gr.rows, width)
        if gr.q_len > 1:
            table = table.expand(gr.q_len, width)
        at = slice(gr.start, gr.end) if gr.token_index is None else gr.token_index
        tables[at, :width] = table
        lengths[at] = gr.lengths
    return tables, lengths
