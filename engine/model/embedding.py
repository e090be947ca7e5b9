"""The token embedding: a dense table, or a GGUF tensor's rows read where the loader mapped them."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tickloom.engine.model import gguf_quants, packing
from tickloom.engine.model.file_pages import drop_file_pages
from tickloom.engine.model.quant import Linear, RawBlocks, Weight, _nbytes
from tickloom.engine.model.quant_grouped import HalfLinear


class Embedding:
    """Token lookup: a dense table, or a GGUF type's rows (Q8_0, Q4_K, ..., F16, BF16) dequantized per lookup.

    The rows stay where the loader found them: when that is a read-only mapping of the GGUF file, only the
    rows looked up are resident (``release_pages`` drops the rest, which the loader read while packing)."""

    __slots__ = ("blocks", "dtype", "half", "table")

    def __init__(self, w: Weight, dtype: torch.dtype) -> None:
        self.table: torch.Tensor | None = None
        self.blocks: RawBlocks | None = None
        self.half: HalfLinear | None = None  # a tied head's bfloat16 tiles, when the rows are read from them
        if isinstance(w, RawBlocks) and (w.kind in gguf_quants.INT_KINDS or w.kind in packing.HALF_KINDS):
            self.blocks = w
        else:
            self.table = (w.dequantize() if isinstance(w, RawBlocks) else w).to(dtype)
        self.dtype = dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return F.embedding(ids, self.table)
        if self.half is not None:
            bits = packing.half_tile_rows(self.half.tiles, ids.cpu().numpy())
            return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(device=ids.device,
                                                                                  dtype=self.dtype)
        assert self.blocks is not None
        rows = torch.from_numpy(gguf_quants.dequantize(self.blocks.kind, self.blocks.data[ids.cpu().numpy()]))
        return rows.reshape(ids.shape[0], -1).to(device=ids.device, dtype=self.dtype)

    def weight(self) -> Weight:
        """The table as a weight (for a tied head)."""
        if self.table is not None:
            return self.table
        assert self.blocks is not None
        return self.blocks

    def read_rows_from(self, head: Linear) -> None:
        """A tied head that holds the table's values as bfloat16 tiles (a bfloat16 model's, ``HalfLinear``) serves
        the lookups too, and the table goes: one copy of the weights, not two (56 MiB on SmolLM2-135M)."""
        if (isinstance(head, HalfLinear) and head.kind == "BF16" and self.dtype == torch.bfloat16
                and self.table is not None and head.bias is None):
            self.half, self.table = head, None

    def release_pages(self) -> None:
        """Drop this process's resident pages of the file mapping the rows live in (none if they are a copy)."""
        if self.blocks is not None:
            drop_file_pages(self.blocks.data)

    def nbytes(self) -> int:
        """Bytes held in memory (mapped file rows count only as they are read)."""
        return _nbytes(self.table)
