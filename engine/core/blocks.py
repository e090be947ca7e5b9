"""The KV block pool and the prefix cache, in one structure because they share every block.

A block is in exactly one of three places:

* **in use**: ``ref[b] > 0``; one reference per block table holding it, so a block shared through the
  prefix cache is in several tables with a matching refcount;
* **free**: unhashed and unreferenced, in ``free`` (reused first);
* **cached**: hashed but unreferenced, in ``cached``, in LRU order (the first entry is evicted first).

Allocation takes only free blocks. Turning cached blocks into free ones is an explicit decision of the core
(``reclaim``), because the reference scheduler's tick reclaims at named points (admission, exhaustion, swap-in and
resume) and the scenarios count "free" and "reclaimable" separately.

Block hashes chain over (parent hash, cache salt, the block's tokens) with blake2b, never Python's ``hash()``,
whose value changes with ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

import attrs

HASH_SIZE = 16
ROOT_HASH = bytes(HASH_SIZE)


_BLAKE2B = hashlib.blake2b(digest_size=HASH_SIZE)
_TOKEN_CODE = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN = array(_TOKEN_CODE, [1]).tobytes()[0] == 0


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian uint32s, the encoding the block hashes cover."""
    packed = array(_TOKEN_CODE, tokens)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def chain_hashes(parent: bytes, packed: bytes, block_size: int, salt: str) -> list[bytes]:
    """The prefix-cache key of each full block in ``packed`` (``pack_tokens``), chained from ``parent``.

    A block's key is blake2b over (its parent's key, the cache salt, its tokens), so it names the block's
    tokens and everything before them.
    """
    prefix = salt.encode()
    step = 4 * block_size
    copy = _BLAKE2B.copy  # copying a fresh hasher is cheaper than constructing one with its parameters
    hashes = []
    for offset in range(0, len(packed) - step + 1, step):
        hasher = copy()
        hasher.update(parent + prefix + packed[offset : offset + step])
        parent = hasher.digest()
        hashes.append(parent)
    return hashes


def block_hash(parent: bytes, tokens: Sequence[int], salt: str) -> bytes:
    """The prefix-cache key of one full block of ``tokens``."""
    return chain_hashes(parent, pack_tokens(tokens), len(tokens), salt)[0]


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens plus room for the next one (the scenarios' block math)."""
    return tokens // block_size + 1


def blocks_holding(tokens: int, block_size: int) -> int:
    """Blocks that ``tokens`` tokens occupy, no room to grow: the ceiling of ``tokens / block_size``."""
    return -(-tokens // block_size)


@attrs.define(slots=True)
class BlockPool:
    """Refcounted blocks with a hash-addressed prefix cache. Pure bookkeeping: no KV data lives here."""

    num_blocks: int
    ref: list[int]
    hash_of: list[bytes | None]
    by_hash: dict[bytes, int]
    free: OrderedDict[int, None]
    cached: OrderedDict[int, None]

    @classmethod
    def create(cls, num_blocks: int) -> BlockPool:
        return cls(
            num_blocks=num_blocks,
            ref=[0] * num_blocks,
            hash_of=[None] * num_blocks,
            by_hash={},
            free=OrderedDict.fromkeys(range(num_blocks)),
            cached=OrderedDict(),
        )

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        """Reclaimable blocks: cached and referenced by no table."""
        return len(self.cached)

    def capacity(self, hits: Collection[int] = ()) -> int:
        """Blocks a request could get: free plus reclaimable, not counting its own prefix hits."""
        return len(self.free) + len(self.cached) - sum(1 for b in hits if b in self.cached)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (the caller checked ``num_free``), each with one reference."""
        if n > len(self.free):
            raise ValueError(f"allocate({n}) with only {len(self.free)} free blocks")
        blocks = []
        for _ in range(n):
            block, _none = self.free.popitem(last=False)
            self.ref[block] = 1
            blocks.append(block)
        return blocks

    def reclaim(self, n: int, protect: Collection[int] = ()) -> int:
        """Evict up to ``n`` cached blocks in LRU order, skipping ``protect``; returns how many became free."""
        if n <= 0:
            return 0
        # Pop from the LRU end instead of copying the whole cache (it can hold thousands of blocks): skipped
        # protected blocks go back to the front in their original order, so the LRU order is exactly what
        # deleting in place would leave.
        cached = self.cached
        free = self.free
        freed = 0
        skipped: list[int] = []
        hash_of = self.hash_of
        by_hash = self.by_hash
        while freed < n and cached:
            block, _none = cached.popitem(last=False)
            if block in protect:
                skipped.append(block)
                continue
            del by_hash[hash_of[block]]  # type: ignore[arg-type]  # every cached block is hashed
            hash_of[block] = None
            free[block] = None
            freed += 1
        for block in reversed(skipped):
            cached[block] = None
            cached.move_to_end(block, last=False)
        return freed

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block, tail first, so a request's prefix outlives its tail in the LRU."""
        for block in reversed(blocks):
            count = self.ref[block] - 1
            self.ref[block] = count
            if count == 0:
                if self.hash_of[block] is None:
                    self.free[block] = None
                else:
                    self.cached[block] = None
            elif count < 0:
                raise ValueError(f"block {block} released more often than it was referenced")

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The blocks holding the longest cached prefix of ``hashes`` (no references change)."""
        hits = []
        for h in hashes:
            block = self.by_hash.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def claim(self, blocks: Iterable[int]) -> None:
        """Add a reference to each prefix-hit block; a cached one stops being reclaimable."""
        for block in blocks:
            if self.ref[block] == 0:
                del self.cached[block]
            self.ref[block] += 1

    def register(self, block: int, h: bytes) -> bool:
        """Give an in-use block its hash, unless the same content is cached already; True if registered."""
        if h in self.by_hash or self.hash_of[block] is not None:
            return False
        self.hash_of[block] = h
        self.by_hash[h] = block
        return True

    def unregister(self, block: int) -> None:
        """Forget a block's hash (its KV cannot be trusted); an unreferenced one becomes plainly free."""
        if self.hash_of[block] is None:
            return
        self._forget_hash(block)
        if block in self.cached:
            del self.cached[block]
            self.free[block] = None

    def _forget_hash(self, block: int) -> None:
        h = self.hash_of[block]
        if h is not None:
            del self.by_hash[h]
            self.hash_of[block] = None
