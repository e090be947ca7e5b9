"""Releasing a file mapping's pages from this process's resident set: a GGUF's tensors are read through a read-only
map (``gguf_blocks``), and once a layer's tiles are made, or a load is done, the bytes it read need not stay
resident (they come back from the page cache if read again)."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np


def drop_file_pages(arr: np.ndarray, whole: bool = True) -> bool:
    """``madvise(MADV_DONTNEED)`` the read-only file mapping ``arr`` is a view of, all of it (``whole``) or the
    whole pages inside ``arr``'s bytes: they leave this process's resident set and come back from the page cache
    when read. Anything not such a view is left alone (on anonymous or writable memory the call would discard
    data), and so is a view that is not one run of bytes."""
    base: Any = arr
    while isinstance(base, np.ndarray):
        if isinstance(base, np.memmap) and isinstance(base.base, mmap.mmap):
            if base.mode != "r" or not hasattr(mmap, "MADV_DONTNEED"):
                return False
            if whole:
                base.base.madvise(mmap.MADV_DONTNEED)
                return True
            if not arr.flags.c_contiguous:
                return False
            at = arr.ctypes.data - np.frombuffer(base.base, dtype=np.uint8).ctypes.data
            start, end = -(-at // mmap.PAGESIZE) * mmap.PAGESIZE, (at + arr.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
            if end > start:
                base.base.madvise(mmap.MADV_DONTNEED, start, end - start)
            return True
        base = base.base
    return False
