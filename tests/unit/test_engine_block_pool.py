"""BlockPool and KVCacheManager: free-queue order, ref counts, prefix hits, allocation."""

from __future__ import annotations

import pytest

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams

BS = 4  # block size for these tests: small numbers keep the arithmetic readable


def _free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


# -- BlockPool -----------------------------------------------------------------------------


def test_pool_never_hands_out_block_zero() -> None:
    pool = BlockPool(6, enable_caching=True)
    assert pool.num_usable_blocks == 5
    assert pool.num_free_blocks == 5
    taken = pool.take(5)
    assert sorted(b.block_id for b in taken) == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="no free KV blocks"):
        pool.take(1)


def test_pool_needs_two_blocks() -> None:
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1, enable_caching=True)


def test_take_sets_refcount_and_release_returns_to_tail_in_order() -> None:
    pool = BlockPool(8, enable_caching=True)
    a = pool.take(3)
    assert [b.block_id for b in a] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in a)
    assert _free_ids(pool) == [4, 5, 6, 7]
    # Released in the given order, appended at the tail (most recently freed last).
    pool.release([a[2], a[0], a[1]])
    assert _free_ids(pool) == [4, 5, 6, 7, 3, 1, 2]
    assert all(b.ref_cnt == 0 for b in a)
    assert pool.usage() == 0.0


def test_release_below_zero_is_an_invariant_error() -> None:
    pool = BlockPool(4, enable_caching=True)
    (b,) = pool.take(1)
    pool.release([b])
    with pytest.raises(AssertionError, match="released too often"):
        pool.release([b])


def test_touch_unfrees_idle_cached_block_and_counts_refs() -> None:
    pool = BlockPool(6, enable_caching=True)
    (b,) = pool.take(1)
    pool.register(b, b"h" * 32)
    pool.release([b])
    assert b.block_id in _free_ids(pool)
    assert pool.get_cached_block(b"h" * 32) is b  # freed but still cached
    pool.touch([b])
    assert b.ref_cnt == 1 and b.block_id not in _free_ids(pool)
    pool.touch([b])  # a second sharer: no queue change, two refs
    assert b.ref_cnt == 2 and pool.num_free_blocks == 4
    pool.release([b])
    assert b.ref_cnt == 1 and b.block_id not in _free_ids(pool)
    pool.release([b])
    assert b.ref_cnt == 0 and _free_ids(pool)[-1] == b.block_id


def test_lru_eviction_of_freed_cached_blocks() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.take(3)
    for i, b in enumerate(blocks):
        pool.register(b, bytes([i]) * 32)
    # Free in the order 2, 1, 3: block 2 is the least recently freed and must go first.
    pool.release([blocks[1], blocks[0], blocks[2]])
    assert _free_ids(pool) == [2, 1, 3]
    (first,) = pool.take(1)
    assert first.block_id == 2
    assert first.block_hash is None
    assert pool.get_cached_block(bytes([1]) * 32) is None  # evicted
    assert pool.get_cached_block(bytes([0]) * 32) is blocks[0]  # still cached
    assert pool.get_cached_block(bytes([2]) * 32) is blocks[2]
    (second,) = pool.take(1)
    assert second.block_id == 1 and pool.get_cached_block(bytes([0]) * 32) is None


def test_register_keeps_first_holder_and_ignores_when_caching_off() -> None:
    pool = BlockPool(6, enable_caching=True)
    a, b = pool.take(2)
    pool.register(a, b"x" * 32)
    pool.register(b, b"x" * 32)
    assert pool.get_cached_block(b"x" * 32) is a and b.block_hash is None
    off = BlockPool(6, enable_caching=False)
    (c,) = off.take(1)
    off.register(c, b"x" * 32)
    assert off.get_cached_block(b"x" * 32) is None and c.block_hash is None


def test_reset_prefix_cache_forgets_hashes() -> None:
    pool = BlockPool(4, enable_caching=True)
    (a,) = pool.take(1)
    pool.register(a, b"y" * 32)
    pool.reset_prefix_cache()
    assert a.block_hash is None and pool.get_cached_block(b"y" * 32) is None


def test_free_queue_remove_middle_keeps_links() -> None:
    pool = BlockPool(6, enable_caching=True)
    middle: KVCacheBlock = pool.blocks[3]
    pool.free_queue.remove(middle)
    assert _free_ids(pool) == [1, 2, 4, 5]
    assert pool.num_free_blocks == 4
    pool.free_queue.append(middle)
    assert _free_ids(pool) == [1, 2, 4, 5, 3]


# -- KVCacheManager ------------------------------------------------------------------------


def test_request_freed_tail_first_so_its_tail_evicts_first() -> None:
    kv = KVCacheManager(16, BS, enable_caching=True)
    r = _req("a", list(range(12)))
    new = kv.allocate_slots(r, 12)
    assert new is not None and [b.block_id for b in new] == [1, 2, 3]
    kv.free(r)
    free = _free_ids(kv.pool)
    assert free[-3:] == [3, 2, 1]  # tail block first, so it is evicted before the head


def test_prefix_hit_reuses_blocks_and_leaves_one_token() -> None:
    kv = KVCacheManager(16, BS, enable_caching=True)
    tokens = list(range(100, 112))  # exactly 3 full blocks
    a = _req("a", tokens)
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 12) is not None
    kv.cache_blocks(a, 12)
    a_ids = kv.block_ids("a")

    # Same 12 tokens: only 2 blocks may hit, the last token must be computed for logits.
    b = _req("b", tokens)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and [h.block_id for h in hits] == a_ids[:2]
    # Longer prompt sharing the prefix: all 3 blocks hit.
    c = _req("c", [*tokens, 7, 7])
    hits_c, n_c = kv.get_computed_blocks(c)
    assert n_c == 12 and [h.block_id for h in hits_c] == a_ids
    # Different first token: the chain breaks at block 0, nothing hits.
    d = _req("d", [1, *tokens[1:], 5])
    assert kv.get_computed_blocks(d) == ([], 0)
    # Queried blocks: a 2 (miss), b 2, c 3, d 3; hits: b 2, c 3.
    assert kv.pool.prefix_queries == 2 + 2 + 3 + 3
    assert kv.pool.prefix_hits == 2 + 3
    assert kv.pool.hit_rate() == pytest.approx(5 / 10)


def test_adopting_hits_shares_blocks_and_counts_refs() -> None:
    kv = KVCacheManager(16, BS, enable_caching=True)
    tokens = list(range(8))
    a = _req("a", [*tokens, 9])
    kv.allocate_slots(a, 9)
    kv.cache_blocks(a, 9)
    b = _req("b", [*tokens, 10, 11])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    new = kv.allocate_slots(b, 2, hits)
    assert new is not None and len(new) == 1
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    kv.free(a)
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    kv.free(b)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_idle_cached_hits_revived_after_free() -> None:
    kv = KVCacheManager(8, BS, enable_caching=True)
    tokens = list(range(9))
    a = _req("a", tokens)
    kv.allocate_slots(a, 9)
    kv.cache_blocks(a, 9)
    kv.free(a)
    assert kv.pool.num_free_blocks == 7
    b = _req("b", tokens)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and all(blk.ref_cnt == 0 for blk in hits)
    assert kv.allocate_slots(b, 1, hits) is not None
    assert all(blk.ref_cnt == 1 for blk in hits)
    assert kv.pool.num_free_blocks == 7 - 3


def test_allocate_slots_returns_none_and_changes_nothing_when_short() -> None:
    kv = KVCacheManager(5, BS, enable_caching=True)  # 4 usable blocks
    a = _req("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None  # 3 blocks
    before_free = _free_ids(kv.pool)
    b = _req("b", list(range(50, 58)))
    assert kv.allocate_slots(b, 8) is None  # needs 2, 1 free
    assert _free_ids(kv.pool) == before_free
    assert kv.num_blocks_of("b") == 0 and "b" not in kv.req_to_blocks
    # Growing a running request past the pool also fails without side effects.
    a.num_computed_tokens = 12
    assert kv.allocate_slots(a, 8) is None
    assert kv.num_blocks_of("a") == 3 and _free_ids(kv.pool) == before_free
    # Exactly what is left fits.
    assert kv.allocate_slots(a, 4) is not None and kv.pool.num_free_blocks == 0


def test_allocate_counts_idle_hits_as_not_free() -> None:
    """An idle cached block adopted as a hit stops being free: the capacity check must
    count it, or the pool would hand the same block out twice."""
    kv = KVCacheManager(5, BS, enable_caching=True)  # 4 usable
    tokens = list(range(8))
    a = _req("a", [*tokens, 1])
    kv.allocate_slots(a, 9)  # 3 blocks
    kv.cache_blocks(a, 9)
    kv.free(a)
    b = _req("b", [*tokens, *range(20, 32)])  # 20 tokens: 5 blocks, 2 of them hits
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    # Needs 3 new blocks; 4 are free but 2 of them are the hits themselves.
    assert kv.allocate_slots(b, 12, hits) is None
    assert all(blk.ref_cnt == 0 for blk in hits) and kv.pool.num_free_blocks == 4
    assert kv.allocate_slots(b, 8, hits) is not None  # 2 new + 2 hits = 4
    assert kv.pool.num_free_blocks == 0


def test_decode_growth_allocates_one_block_per_block_size_tokens() -> None:
    kv = KVCacheManager(16, BS, enable_caching=False)
    r = _req("r", list(range(5)))
    assert len(kv.allocate_slots(r, 5) or []) == 2
    r.num_computed_tokens = 5
    grown = []
    for _ in range(6):  # positions 5..10
        new = kv.allocate_slots(r, 1)
        assert new is not None
        grown.append(len(new))
        r.num_computed_tokens += 1
    assert grown == [0, 0, 0, 1, 0, 0]
    assert kv.num_blocks_of("r") == 3


def test_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(16, BS, enable_caching=False)
    a = _req("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.cache_blocks(a, 9)
    assert kv.get_computed_blocks(_req("b", list(range(9)))) == ([], 0)
    assert kv.pool.hit_rate() == 0.0
