"""The prefix cache as a sequence sees it: the hashes of its full blocks, offering them to the cache, and whether
it may skip computing a cached prefix. (The pool's side, lookup, claim and reclaim, is ``blocks.BlockPool``.)"""

from __future__ import annotations

from tickloom.engine.core.blocks import ROOT_HASH, chain_hashes, pack_tokens
from tickloom.engine.core.state import CoreState, Seq


def may_hit_cache(seq: Seq) -> bool:
    """Whether the prefix cache may skip computing ``seq``'s cached prefix. Not for a request that asks for prompt
    logprobs before its first token: every prompt position must be computed to report them (vLLM does the same).
    Its blocks still enter the cache for others, and once it has output 0 (say after a requeue) it may hit."""
    return seq.params.prompt_logprobs is None or bool(seq.outputs)


def full_block_hashes(state: CoreState, seq: Seq, num_tokens: int) -> list[bytes]:
    """Hashes of the full blocks among the first ``num_tokens`` tokens, extending ``seq.hashes`` as needed."""
    size = state.config.block_size
    hashes = seq.hashes
    have, want = len(hashes), num_tokens // size
    if want > have:
        packed = pack_tokens(seq.tokens(have * size, want * size))
        hashes += chain_hashes(hashes[-1] if hashes else ROOT_HASH, packed, size, seq.salt)
    return hashes[:want]


def cache_full_blocks(state: CoreState, seq: Seq, num_tokens: int) -> list[int]:
    """Offer the full blocks of the first ``num_tokens`` tokens to the prefix cache; returns those registered."""
    if not state.config.prefix_caching:
        return []
    registered = []
    blocks = seq.block_ids
    pool = state.pool
    by_hash = pool.by_hash
    hash_of = pool.hash_of
    hashes = full_block_hashes(state, seq, min(num_tokens, len(blocks) * state.config.block_size))
    for block, h in zip(blocks, hashes, strict=False):  # there are no more hashes than blocks
        # ``BlockPool.register``, inlined: every prefill chunk and every retirement offers all the full blocks.
        if h not in by_hash and hash_of[block] is None:
            hash_of[block] = h
            by_hash[h] = block
            registered.append(block)
    return registered
