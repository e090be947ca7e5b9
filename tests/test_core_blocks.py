"""C18: the block pool's own contract (``engine/core/blocks.py``), one rule per test.

The scenario tests reach the pool through the core; these pin the rules the core relies on without looking:
what ``register`` refuses, what ``reclaim`` returns and in which order it evicts, and where a block goes when it
is released or unregistered.
"""

from __future__ import annotations

import pytest

from tickloom.engine.core.blocks import BlockPool, block_hash, chain_hashes, pack_tokens


def _hash(n: int) -> bytes:
    return block_hash(bytes(16), [n] * 4, "")


def _cached_pool(blocks: int, cached: int) -> BlockPool:
    """A pool whose blocks 0..cached-1 are cached (hashed, unreferenced), released in that order."""
    pool = BlockPool.create(blocks)
    taken = pool.allocate(cached)
    for block in taken:
        assert pool.register(block, _hash(block)) is True
    for block in taken:
        pool.release([block])
    assert list(pool.cached) == taken
    return pool


def test_register_gives_an_in_use_block_its_hash() -> None:
    pool = BlockPool.create(4)
    (block,) = pool.allocate(1)
    assert pool.register(block, _hash(1)) is True
    assert pool.hash_of[block] == _hash(1) and pool.by_hash[_hash(1)] == block
    assert pool.lookup([_hash(1)]) == [block]


def test_register_refuses_content_that_is_cached_already() -> None:
    """Two blocks with one hash would make the cache's map point at whichever registered last, and evicting
    either would unmap the other."""
    pool = BlockPool.create(4)
    first, second = pool.allocate(2)
    assert pool.register(first, _hash(1)) is True
    assert pool.register(second, _hash(1)) is False
    assert pool.hash_of[second] is None and pool.by_hash == {_hash(1): first}
    pool.release([second])
    assert second in pool.free and second not in pool.cached, "an unhashed block is plainly free"


def test_register_refuses_a_block_that_has_a_hash() -> None:
    pool = BlockPool.create(4)
    (block,) = pool.allocate(1)
    assert pool.register(block, _hash(1)) is True
    assert pool.register(block, _hash(2)) is False
    assert pool.hash_of[block] == _hash(1) and _hash(2) not in pool.by_hash


@pytest.mark.parametrize("n", [0, -1])
def test_reclaim_of_nothing_frees_nothing_and_says_so(n: int) -> None:
    pool = _cached_pool(4, 2)
    assert pool.reclaim(n) == 0
    assert list(pool.cached) == [0, 1] and pool.num_free == 2


def test_reclaim_returns_how_many_it_freed_which_may_be_fewer_than_asked() -> None:
    pool = _cached_pool(4, 3)
    assert pool.reclaim(2, protect={0}) == 2
    assert pool.reclaim(5, protect={0}) == 0, "only the protected block is left"
    assert list(pool.cached) == [0]


def test_reclaim_evicts_least_recently_released_first_and_keeps_the_order_of_what_it_skips() -> None:
    pool = _cached_pool(6, 5)
    assert pool.reclaim(2, protect={0, 2}) == 2
    assert list(pool.cached) == [0, 2, 4], "1 and 3 evicted; the skipped 0 and 2 stay first, in their order"
    assert pool.hash_of[1] is None and _hash(1) not in pool.by_hash
    assert list(pool.free)[-2:] == [1, 3], "evicted blocks join the free list in eviction order"


def test_release_sends_hashed_blocks_to_the_cache_and_others_to_the_free_list() -> None:
    pool = BlockPool.create(4)
    hashed, plain = pool.allocate(2)
    pool.register(hashed, _hash(7))
    pool.release([hashed, plain])
    assert list(pool.cached) == [hashed] and list(pool.free)[-1] == plain
    with pytest.raises(ValueError, match="released more often"):
        pool.release([plain])


def test_unregister_turns_a_cached_block_into_a_free_one() -> None:
    pool = _cached_pool(4, 2)
    pool.unregister(1)
    assert list(pool.cached) == [0] and list(pool.free)[-1] == 1 and pool.hash_of[1] is None
    assert pool.lookup([_hash(1)]) == []


def test_chain_hashes_cover_only_full_blocks() -> None:
    tokens = list(range(11))
    assert len(chain_hashes(bytes(16), pack_tokens(tokens), 4, "")) == 2
    assert len(chain_hashes(bytes(16), pack_tokens(tokens[:8]), 4, "")) == 2
    assert len(chain_hashes(bytes(16), pack_tokens(tokens[:7]), 4, "")) == 1


def test_allocate_refuses_more_than_the_free_blocks_and_takes_nothing() -> None:
    pool = _cached_pool(4, 2)
    with pytest.raises(ValueError, match=r"^allocate\(3\) with only 2 free blocks$"):
        pool.allocate(3)
    assert pool.num_free == 2 and pool.allocate(2) == [2, 3], "free blocks go out in order"
