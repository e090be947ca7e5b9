"""Block copies between the device KV cache and host memory.

On CPU a copy is a plain synchronous ``index_select``. On CUDA copies run on a dedicated stream that
first waits for the compute stream, land in pinned host memory taken from a double-buffered pool, and
are tracked with events: a copy-out hands back a ``HostKV`` whose ``wait()`` blocks until its event
has completed, and the next forward waits for any copy-in before it reads the blocks.
"""

from __future__ import annotations

from typing import Any

import torch

from tickloom.engine.model.kv_cache import HostKV, PagedKVCache


class PinnedPool:
    """Two reusable pinned staging slabs (double buffering); falls back to fresh pinned tensors when
    both are still in use, and to pageable memory where pinning is unavailable (CPU-only torch)."""

    def __init__(self) -> None:
        self._slabs: list[torch.Tensor] = []
        self._busy: list[Any] = []  # event per slab, or None when free
        self._next = 0

    @staticmethod
    def _pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        try:
            return t.pin_memory()
        except (RuntimeError, NotImplementedError):
            return t

    def take(self, numel: int, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """A flat staging tensor of at least ``numel`` elements and its slab index (-1 if fresh)."""
        for _ in range(2):
            i = self._next
            self._next = (self._next + 1) % 2
            if i >= len(self._slabs):
                self._slabs.append(self._pinned(numel, dtype))
                self._busy.append(None)
            ev = self._busy[i]
            if ev is not None and not ev.query():
                continue
            slab = self._slabs[i]
            if slab.numel() < numel or slab.dtype != dtype:
                slab = self._slabs[i] = self._pinned(numel, dtype)
            return i, slab[:numel]
        return -1, self._pinned(numel, dtype)

    def mark_busy(self, index: int, event: Any) -> None:
        if index >= 0:
            self._busy[index] = event


class CopyEngine:
    """Copies blocks out and in; on CUDA orders them with a side stream and events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._pool = PinnedPool() if self.cuda else None
        self._stream: Any = torch.cuda.Stream(device=device) if self.cuda else None  # type: ignore[no-untyped-call]
        self._pending_in: list[Any] = []

    def before_compute(self) -> None:
        """Make the compute stream wait for copy-ins issued since the last step."""
        if self.cuda and self._pending_in:
            cur = torch.cuda.current_stream(self.device)
            for ev in self._pending_in:
                cur.wait_event(ev)
            self._pending_in.clear()

    def copy_out(self, kv: PagedKVCache, block_ids: list[int], num_tokens: int) -> HostKV:
        if not self.cuda:
            k, v = kv.copy_blocks_out(block_ids)
            return HostKV(k, v, num_tokens)
        shape = (kv.num_layers, len(block_ids), kv.block_size, kv.kv_heads, kv.head_dim)
        numel = 1
        for s in shape:
            numel *= s
        # The result must outlive the staging slab, so it gets its own pinned buffers; the slab pool
        # is used for copy-ins, where the host data only needs to live until the H2D copy lands.
        k_host = PinnedPool._pinned(numel, kv.dtype).view(shape)
        v_host = PinnedPool._pinned(numel, kv.dtype).view(shape)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            kv.copy_blocks_out(block_ids, k_host, v_host)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(self._stream)
        return HostKV(k_host, v_host, num_tokens, event=ev)

    def copy_in(self, kv: PagedKVCache, block_ids: list[int], host: HostKV) -> None:
        host.wait()
        assert host.k is not None and host.v is not None
        if not self.cuda:
            kv.copy_blocks_in(block_ids, host.k, host.v)
            return
        assert self._pool is not None
        k, v = host.k, host.v
        if not k.is_pinned():
            idx, slab = self._pool.take(k.numel() * 2, k.dtype)
            slab[: k.numel()].copy_(k.reshape(-1))
            slab[k.numel() :].copy_(v.reshape(-1))
            k = slab[: k.numel()].view(host.k.shape)
            v = slab[host.k.numel() :].view(host.v.shape)
        else:
            idx = -1
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            kv.copy_blocks_in(block_ids, k, v)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(self._stream)
        if self._pool is not None:
            self._pool.mark_busy(idx, ev)
        self._pending_in.append(ev)
