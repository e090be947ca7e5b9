"""Paged KV cache: one tensor per layer holding K and V, slot writes, block gathers, host copies."""

from __future__ import annotations

import mmap

import torch

from tickloom.engine.model.types import HostKV

__all__ = ["HostKV", "PagedKVCache", "zeroed_pool"]


def zeroed_pool(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A zero-filled flat tensor, and on CPU the anonymous mapping behind it (keep it alive with the tensor).

    ``torch.zeros`` writes every page, so a pool sized for the worst case is resident from the start. An anonymous
    ``mmap`` is zero-filled by the kernel and a page becomes resident only when first written, so on CPU the pool
    costs what the sequences actually use."""
    if device.type != "cpu" or numel == 0:
        return torch.zeros(numel, dtype=dtype, device=device), None
    itemsize = torch.empty(0, dtype=dtype).element_size()
    buf = mmap.mmap(-1, numel * itemsize)
    return torch.frombuffer(buf, dtype=dtype, count=numel), buf


class PagedKVCache:
    """Per layer, one tensor ``2 * kv_heads x num_blocks x block_size x head_dim``: K's heads, then V's.

    A token at position ``p`` of a request lives in slot ``table[p // block_size] * block_size +
    p % block_size``. Why this layout: a step's new K and V leave the fused qkv projection side by side, so one
    ``index_copy_`` stores both; one ``index_select`` gathers both; and the gathered ``kv_heads x rows x context x
    head_dim`` halves are contiguous, which is what the attention matmuls want (``block_size x kv_heads`` order
    made every decode step transpose the gathered context). ``k[layer]`` and ``v[layer]`` are views in the
    ``num_blocks x block_size x kv_heads x head_dim`` order the host copies use.
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
        shape = (2 * kv_heads, num_blocks, block_size, head_dim)
        per_layer = 2 * kv_heads * num_blocks * block_size * head_dim
        flat, self._mapping = zeroed_pool(num_layers * per_layer, dtype, device)
        self.kv = [flat[n * per_layer : (n + 1) * per_layer].view(shape) for n in range(num_layers)]
        self.k = [t[:kv_heads].permute(1, 2, 0, 3) for t in self.kv]
        self.v = [t[kv_heads:].permute(1, 2, 0, 3) for t in self.kv]

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv`` (``tokens x 2 * kv_heads x head_dim``: K's heads, then V's) at flat slot indices ``slots``."""
        flat = self.kv[layer].view(2 * self.kv_heads, self.num_blocks * self.block_size, self.head_dim)
        flat.index_copy_(1, slots, kv.transpose(0, 1))

    def gather(self, layer: int, block_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks ``block_index`` (flat, ``rows * blocks_per_row``) as K and V, each ``kv_heads x n x block x dim``
        and contiguous."""
        both = self.kv[layer].index_select(1, block_index)
        return both[: self.kv_heads], both[self.kv_heads :]

    def copy_blocks_out(
        self, block_ids: list[int], out_k: torch.Tensor | None = None, out_v: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy blocks of every layer into (optionally preallocated, e.g. pinned) host tensors shaped
        ``layers x blocks x block_size x kv_heads x head_dim``."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        shape = (self.num_layers, len(block_ids), self.block_size, self.kv_heads, self.head_dim)
        if out_k is None or out_v is None:
            out_k = torch.empty(shape, dtype=self.dtype, device="cpu")
            out_v = torch.empty(shape, dtype=self.dtype, device="cpu")
        non_blocking = self.device.type == "cuda" and out_k.is_pinned()
        h = self.kv_heads
        for layer in range(self.num_layers):
            both = self.kv[layer].index_select(1, idx).permute(1, 2, 0, 3)
            out_k[layer].copy_(both[..., :h, :], non_blocking=non_blocking)
            out_v[layer].copy_(both[..., h:, :], non_blocking=non_blocking)
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
            both = torch.cat((k[layer], v[layer]), dim=2).to(self.device, non_blocking=non_blocking)
            self.kv[layer].index_copy_(1, idx, both.permute(2, 0, 1, 3))
