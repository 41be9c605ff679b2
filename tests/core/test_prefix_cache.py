"""Prefix cache index: cuts, the last-token rule, collision guard, refcounts and LRU eviction."""

from __future__ import annotations

import pytest

import dgpp.sched.prefix_cache as pc
from dgpp.sched.block_pool import BlockPool, OutOfBlocks, SlotPool
from dgpp.sched.prefix_cache import PrefixCache


def fill(pool: BlockPool, cache: PrefixCache, prompt: list[int], upto: int) -> list[int]:
    table = pool.allocate(pool.blocks_for_tokens(len(prompt)))
    cache.insert(prompt, table, upto)
    for b in table:  # the request retires: only the cache's references remain
        pool.decref(b)
    return table


def test_match_attaches_at_cuts_and_never_the_last_token() -> None:
    pool = BlockPool(16, 4)
    cache = PrefixCache(pool, cut=8)
    prompt = list(range(100, 124))
    table = fill(pool, cache, prompt, 16)
    assert cache.num_entries == 4 and pool.num_in_use == 4
    m = cache.match(prompt)
    assert (m.position, m.blocks) == (16, table[:4])
    assert all(pool.refcount[b] == 2 for b in m.blocks)
    assert cache.match(prompt[:16]).position == 8  # token 16 must be recomputed for its logits
    assert cache.match(prompt[:12] + [1] * 8).position == 8  # diverges in block 3: back to cut 8
    assert cache.match([7] + prompt[1:]).position == 0
    assert cache.stats.hits == 3 and cache.stats.misses == 1
    with pytest.raises(ValueError, match="multiple of the KV block size"):
        PrefixCache(pool, cut=6)


def test_hash_collision_is_caught_by_token_comparison(monkeypatch) -> None:
    pool = BlockPool(8, 4)
    cache = PrefixCache(pool, cut=4)
    monkeypatch.setattr(pc, "chain_key", lambda parent, tokens: b"same")
    fill(pool, cache, [1, 2, 3, 4, 5], 4)
    assert cache.match([9, 9, 9, 9, 9]).position == 0
    assert cache.match([1, 2, 3, 4, 9]).position == 4


def test_lru_eviction_frees_only_unreferenced_blocks_deepest_first() -> None:
    pool = BlockPool(6, 2)
    cache = PrefixCache(pool, cut=2)
    fill(pool, cache, [1, 2, 3, 4, 0], 4)  # entries A1, A2 (older)
    fill(pool, cache, [5, 6, 0], 2)  # entry B1 (newer)
    held = cache.match([1, 2, 3, 4, 0])  # a live request holds A1, A2
    assert pool.num_free == 3
    cache.evict_blocks(4)
    assert pool.num_free == 4 and cache.num_entries == 2  # only B1 could go
    with pytest.raises(OutOfBlocks):
        pool.allocate(5)
    for b in held.blocks:
        pool.decref(b)
    cache.evict_blocks(5)  # A2 (deeper) goes before A1 at equal age
    assert cache.num_entries == 1 and cache.match([1, 2, 9]).position == 2


def test_hybrid_needs_a_snapshot_at_the_cut() -> None:
    pool = BlockPool(16, 4)
    slots = SlotPool(live=2, snapshots=1)
    copies: list[tuple[int, int]] = []
    cache = PrefixCache(pool, cut=4, hybrid=True, slots=slots, copy_state=lambda s, d: copies.append((s, d)))
    prompt = list(range(20))
    table = pool.allocate(5)
    cache.insert(prompt, table, 4)  # no snapshot at 4
    cache.insert(prompt, table, 12, state_slot=0)
    assert copies == [(0, 2)] and cache.num_snapshots == 1
    m = cache.match(prompt)
    assert (m.position, m.snapshot_slot) == (12, 2)
    assert cache.match(prompt[:10] + [99] * 5).position == 0  # blocks match to 8 but no snapshot there
    other = [50 + t for t in prompt]
    cache.insert(other, pool.allocate(5), 8, state_slot=1)  # evicts the LRU snapshot for a slot
    assert cache.num_snapshots == 1 and cache.match(prompt).position == 0
    assert cache.match(other).position == 8


def test_block_granularity_attaches_at_any_full_block() -> None:
    """Where prefill rows do not depend on chunking, ``attach`` is the block size: a prompt shorter than one
    chunk is indexed and reused block by block (at ``cut`` granularity it would never hit)."""
    pool = BlockPool(16, 4)
    cache = PrefixCache(pool, cut=16, attach=4)
    prompt = list(range(100, 114))  # 14 tokens: three full blocks, less than one cut
    table = fill(pool, cache, prompt, 12)
    assert cache.num_entries == 3
    m = cache.match(prompt)
    assert (m.position, m.blocks) == (12, table[:3])
    assert cache.match(prompt[:12]).position == 8  # never the last prompt token
    assert cache.match(prompt[:6] + [1] * 8).position == 4  # diverges in block 1
    at_cuts = PrefixCache(BlockPool(16, 4), cut=16)
    fill(at_cuts.pool, at_cuts, prompt, 12)  # not a cut: nothing indexed
    assert at_cuts.num_entries == 0 and at_cuts.match(prompt).position == 0
    for bad in (6, 8 * 3, 32):  # not a block multiple, does not divide the cut
        with pytest.raises(ValueError, match="attach granularity"):
            PrefixCache(pool, cut=16, attach=bad)
    with pytest.raises(ValueError, match="only at cuts"):
        PrefixCache(
            pool, cut=16, attach=4, hybrid=True, slots=SlotPool(live=1, snapshots=1), copy_state=print
        )


def test_block_attach_only_where_chunking_changes_no_bits() -> None:
    from dgpp.config_schema import EngineConfig
    from dgpp.server_assembly import prefill_chunking_exact

    assert prefill_chunking_exact("cpu", EngineConfig())
    assert not prefill_chunking_exact("cuda:0", EngineConfig())  # the flash prefill kernel tiles by chunk
    assert prefill_chunking_exact("cuda:0", EngineConfig(batch_invariant=True))
