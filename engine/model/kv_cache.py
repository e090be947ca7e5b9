"""Paged KV cache: per-layer block tensors, slot writes, block gathers, host copies."""

from __future__ import annotations

import torch

from tickloom.engine.model.types import HostKV

__all__ = ["HostKV", "PagedKVCache"]


class PagedKVCache:
    """K/V tensors shaped ``num_blocks x block_size x kv_heads x head_dim``, one pair per layer.

    A token at position ``p`` of a request lives in slot ``table[p // block_size] * block_size +
    p % block_size``. Gathers use ``index_select(..., out=)`` into reusable scratch buffers.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._scratch_k = torch.empty(0, dtype=dtype, device=device)
        self._scratch_v = torch.empty(0, dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (``tokens x kv_heads x head_dim``) at flat slot indices ``slots``."""
        flat = (self.num_blocks * self.block_size, self.kv_heads, self.head_dim)
        self.k[layer].view(flat).index_copy_(0, slots, k)
        self.v[layer].view(flat).index_copy_(0, slots, v)

    def reserve_scratch(self, num_blocks: int) -> None:
        """Make sure gathers of up to ``num_blocks`` blocks need no allocation."""
        need = num_blocks * self.block_size * self.kv_heads * self.head_dim
        if self._scratch_k.numel() < need:
            self._scratch_k = torch.empty(need, dtype=self.dtype, device=self.device)
            self._scratch_v = torch.empty(need, dtype=self.dtype, device=self.device)

    def gather(self, layer: int, block_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``block_index`` (flat, ``rows * blocks_per_row``) as two ``n x block x heads x dim``."""
        n = int(block_index.shape[0])
        self.reserve_scratch(n)
        shape = (n, self.block_size, self.kv_heads, self.head_dim)
        numel = n * self.block_size * self.kv_heads * self.head_dim
        kout = self._scratch_k[:numel].view(shape)
        vout = self._scratch_v[:numel].view(shape)
        torch.index_select(self.k[layer], 0, block_index, out=kout)
        torch.index_select(self.v[layer], 0, block_index, out=vout)
        return kout, vout

    def copy_blocks_out(
        self, block_ids: list[int], out_k: torch.Tensor | None = None, out_v: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy blocks of every layer into (optionally preallocated, e.g. pinned) host tensors."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        shape = (self.num_layers, len(block_ids), self.block_size, self.kv_heads, self.head_dim)
        if out_k is None or out_v is None:
            out_k = torch.empty(shape, dtype=self.dtype, device="cpu")
            out_v = torch.empty(shape, dtype=self.dtype, device="cpu")
        non_blocking = self.device.type == "cuda" and out_k.is_pinned()
        for layer in range(self.num_layers):
            out_k[layer].copy_(self.k[layer].index_select(0, idx), non_blocking=non_blocking)
            out_v[layer].copy_(self.v[layer].index_select(0, idx), non_blocking=non_blocking)
        return out_k, out_v

    def copy_blocks_in(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write host tensors (``layers x blocks x ...``) into the first of the given device blocks.

        The core may hand over more blocks than were spilled (room for the next token); the rest stay as they are.
        """
        if k.shape[1] > len(block_ids):
            raise ValueError(f"host KV holds {k.shape[1]} blocks, only {len(block_ids)} block ids given")
        idx = torch.tensor(block_ids[: k.shape[1]], dtype=torch.long, device=self.device)
        non_blocking = self.device.type == "cuda" and k.is_pinned()
        for layer in range(self.num_layers):
            self.k[layer].index_copy_(0, idx, k[layer].to(self.device, non_blocking=non_blocking))
            self.v[layer].index_copy_(0, idx, v[layer].to(self.device, non_blocking=non_blocking))
