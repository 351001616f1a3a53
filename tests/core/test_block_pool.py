"""Tests for the block pool, its free queue and its prefix map (kv_cache/block_pool.py)."""

from __future__ import annotations

import pytest

from kvconnector_core.errors import ConfigError, InvariantError, NoFreeBlocksError
from kvconnector_core.kv_cache.block_pool import (
    BlockHashToBlockMap,
    BlockPool,
    FreeKVCacheBlockQueue,
    GPUBlockPoolView,
    KVCacheBlock,
)
from kvconnector_core.kv_cache.hashing import make_block_hash_with_group_id
from kvconnector_core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, to_external_hash

from _core_helpers import FakeRequest, cache_at_positions

BS = 4


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def make_pool(
    n: int = 11, *, events: bool = True, caching: bool = True, medium: str = "GPU"
) -> BlockPool:
    return BlockPool(n, caching, BS, enable_kv_cache_events=events, medium=medium)


# -- construction ---------------------------------------------------------------


def test_null_block_is_block_zero_and_not_free():
    """Block 0 is the null block: marked is_null and never in the free queue."""
    pool = make_pool(5)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.is_null
    assert not any(b.is_null for b in pool.blocks[1:])
    assert free_ids(pool) == [1, 2, 3, 4]
    assert pool.get_num_free_blocks() == 4


@pytest.mark.parametrize("n", [0, 1])
def test_too_few_blocks_is_config_error(n):
    """A pool needs the null block plus at least one usable block."""
    with pytest.raises(ConfigError, match=f"num_blocks={n}"):
        BlockPool(n, True, BS)


def test_bad_hash_block_size_is_config_error():
    """A non-positive hash block size is rejected."""
    with pytest.raises(ConfigError, match="hash_block_size=0"):
        BlockPool(4, True, 0)


def test_block_pool_satisfies_gpu_block_pool_view():
    """BlockPool implements the GPUBlockPoolView protocol handed to connectors."""
    pool = make_pool()
    assert isinstance(pool, GPUBlockPoolView)
    assert pool.num_gpu_blocks == 11


# -- free queue -------------------------------------------------------------------


def test_free_queue_remove_from_middle_keeps_order():
    """Removing a block from the middle of the free queue unlinks only that block."""
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[3])
    assert [b.block_id for b in q] == [0, 1, 2, 4, 5]
    assert q.num_free_blocks == 5
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None
    assert blocks[2].next_free_block is blocks[4] and blocks[4].prev_free_block is blocks[2]


def test_free_queue_remove_absent_block_raises():
    """Removing a block that is not in the queue is an invariant error."""
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[1])
    with pytest.raises(InvariantError):
        q.remove(blocks[1])


def test_free_queue_popleft_n_append_prepend():
    """popleft_n takes the front, append adds at the back, prepend_n keeps its order at the
    front."""
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q.popleft_n(2)] == [0, 1]
    q.append(blocks[0])
    q.prepend_n([blocks[1], KVCacheBlock(9)])
    assert [b.block_id for b in q] == [1, 9, 2, 3, 4, 5, 0]
    assert q.num_free_blocks == 7
    assert q.popleft().block_id == 1


def test_free_queue_popleft_n_too_many_raises():
    """Asking the queue for more blocks than it holds raises NoFreeBlocksError."""
    q = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(2)])
    with pytest.raises(NoFreeBlocksError):
        q.popleft_n(3)
    assert q.num_free_blocks == 2


def test_free_queue_popleft_on_empty_queue_raises_no_free_blocks():
    """popleft on an empty queue is "no free blocks", not a broken-link invariant error."""
    q = FreeKVCacheBlockQueue([KVCacheBlock(0)])
    q.popleft()
    with pytest.raises(NoFreeBlocksError):
        q.popleft()
    assert q.num_free_blocks == 0


# -- get_new_blocks / touch / free ------------------------------------------------


def test_get_new_blocks_pops_front_with_ref_one():
    """New blocks come from the front of the free queue with ref count 1."""
    pool = make_pool()
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.get_num_free_blocks() == 7
    assert free_ids(pool) == [4, 5, 6, 7, 8, 9, 10]


def test_get_new_blocks_not_enough_raises_with_numbers():
    """Asking for more blocks than are free raises NoFreeBlocksError naming both numbers."""
    pool = make_pool(5)
    pool.get_new_blocks(2)
    with pytest.raises(NoFreeBlocksError, match=r"5 blocks.*2 free") as info:
        pool.get_new_blocks(5)
    assert info.value.requested == 5 and info.value.available == 2
    assert pool.get_num_free_blocks() == 2
    assert free_ids(pool) == [3, 4]


def test_touch_free_cached_block_takes_it_out_of_the_queue():
    """Touching a free cached block removes it from the middle of the queue and sets ref 1."""
    pool = make_pool(6)
    req = FakeRequest("r", range(8), BS)
    blocks = cache_at_positions(pool, req, [0, 1], BS)
    before = free_ids(pool)
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1
    assert free_ids(pool) == [i for i in before if i != blocks[0].block_id]
    assert pool.get_num_free_blocks() == len(before) - 1


def test_touch_in_use_block_only_increments_ref():
    """Touching a block in use increments its ref count and leaves the queue alone."""
    pool = make_pool(6)
    (b,) = pool.get_new_blocks(1)
    before = free_ids(pool)
    pool.touch([b])
    assert b.ref_cnt == 2
    assert free_ids(pool) == before


def test_touch_counts_only_revived_blocks_even_when_it_raises():
    """The free count drops by the blocks a touch takes out of the queue (not the null
    block, not blocks already referenced), also up to a block that is corrupt."""
    pool = make_pool(6)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([b, c])
    free = pool.get_num_free_blocks()
    pool.touch([pool.null_block, a, b])  # only b is revived
    assert pool.get_num_free_blocks() == free - 1
    pool.free_blocks([b])
    c.next_free_block = None  # corrupt: ref count 0 but unlinked
    with pytest.raises(InvariantError, match="not in the free queue"):
        pool.touch([a, b, c])  # b revived, then c raises
    assert pool.get_num_free_blocks() == free - 1


def test_touch_skips_null_block_in_queue():
    """Touching the null block never changes the free queue."""
    pool = make_pool(4)
    pool.touch([pool.null_block])
    assert free_ids(pool) == [1, 2, 3]


def test_free_unhashed_blocks_go_to_front():
    """A freed block without a hash is reused first."""
    pool = make_pool(6)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([b])
    assert free_ids(pool)[0] == b.block_id
    assert b.ref_cnt == 0


def test_free_hashed_blocks_go_to_back():
    """A freed cached block is evicted last (LRU)."""
    pool = make_pool(6)
    req = FakeRequest("r", range(4), BS)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [a], 0, 1, BS, 0)
    pool.free_blocks([a])
    assert free_ids(pool)[-1] == a.block_id


def test_free_shared_block_stays_in_use():
    """A block with two references stays out of the free queue after one free."""
    pool = make_pool(6)
    (a,) = pool.get_new_blocks(1)
    pool.touch([a])
    pool.free_blocks([a])
    assert a.ref_cnt == 1
    assert a.block_id not in free_ids(pool)


def test_free_below_zero_raises():
    """Freeing a block whose ref count is already 0 is an invariant error."""
    pool = make_pool(4)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(InvariantError):
        pool.free_blocks([a])


def test_free_skips_null_block():
    """The null block in a freed list is ignored (it is never freed)."""
    pool = make_pool(4)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block, a, pool.null_block])
    assert pool.get_num_free_blocks() == 3
    assert 0 not in free_ids(pool)


def test_free_skips_a_touched_null_block():
    """touch counts the null block too; freeing it once must not queue it."""
    pool = make_pool(4)
    (a,) = pool.get_new_blocks(1)
    pool.touch([pool.null_block])  # ref count 1, like a sliding-window table entry
    pool.free_blocks([pool.null_block, a])
    assert pool.get_num_free_blocks() == 3
    assert 0 not in free_ids(pool)


def test_free_links_cached_blocks_in_order_and_counts_them():
    """Several cached blocks freed in one call reach the back in order; counts stay right."""
    pool = make_pool(8)
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(FakeRequest("r", range(4 * BS), BS), blocks, 0, 4, BS, 0)
    pool.free_blocks([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert free_ids(pool)[-4:] == [blocks[i].block_id for i in (2, 0, 3, 1)]
    assert pool.get_num_free_blocks() == 7
    assert len(pool.free_block_queue.get_all_free_blocks()) == 7


def test_prefill_free_order_matches_vllm():
    """Two requests sharing a 3-block prefix leave the free queue as [5,4,6..10,3,2,1] (vLLM
    test_prefill)."""
    pool = make_pool(11)
    common = list(range(3 * BS))
    r0 = FakeRequest("r0", common + [100, 101, 102], BS)
    r1 = FakeRequest("r1", common + [200, 201], BS)
    blocks0 = pool.get_new_blocks(4)  # [1, 2, 3, 4]; block 4 partial
    pool.cache_full_blocks(r0, blocks0, 0, 3, BS, 0)
    hit = [pool.get_cached_block(h, [0])[0] for h in r1.block_hashes[:3]]
    assert [b.block_id for b in hit] == [1, 2, 3]
    pool.touch(hit)
    assert [b.ref_cnt for b in hit] == [2, 2, 2]
    blocks1 = hit + pool.get_new_blocks(1)  # [1, 2, 3, 5]
    assert blocks1[-1].block_id == 5
    pool.free_blocks(reversed(blocks0))
    pool.free_blocks(reversed(blocks1))
    assert free_ids(pool) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]


def test_unhashed_blocks_freed_together_keep_given_order():
    """Several unhashed blocks freed in one call are prepended in the given order."""
    pool = make_pool(6)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool)[:3] == [3, 2, 1]


# -- caching ------------------------------------------------------------------------


def test_cache_full_blocks_sets_hash_and_map():
    """Cached blocks get the request's group-keyed hashes and are found by lookup."""
    pool = make_pool()
    req = FakeRequest("r", range(3 * BS), BS)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 3, BS, 0)
    for blk, h in zip(blocks, req.block_hashes):
        assert blk.block_hash == make_block_hash_with_group_id(h, 0)
        assert pool.get_cached_block(h, [0]) == [blk]
    assert set(pool.iter_cached_blocks()) == set(blocks)


def test_cache_full_blocks_emits_one_block_stored():
    """Caching a range emits exactly one BlockStored with hashes, tokens, size, medium and group."""
    pool = make_pool()
    req = FakeRequest("r", range(3 * BS + 1), BS, lora_name="lora-x")
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(req, blocks, 0, 3, BS, 0)
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [to_external_hash(h) for h in req.block_hashes]
    assert ev.parent_block_hash is None
    assert ev.token_ids == list(range(3 * BS))
    assert ev.block_size == BS
    assert ev.medium == "GPU"
    assert ev.group_idx == 0
    assert ev.lora_name == "lora-x"


@pytest.mark.parametrize(("num_blocks", "split"), [(4, 2), (3, 1)])
def test_cache_full_blocks_parent_is_previous_hash(num_blocks, split):
    """A second caching call names the last already-cached block's hash as parent (hash 0
    too, when exactly one block was cached before)."""
    pool = make_pool()
    req = FakeRequest("r", range(num_blocks * BS), BS)
    blocks = pool.get_new_blocks(num_blocks)
    pool.cache_full_blocks(req, blocks, 0, split, BS, 0)
    pool.take_events()
    pool.cache_full_blocks(req, blocks, split, num_blocks, BS, 0)
    (ev,) = pool.take_events()
    assert ev.parent_block_hash == to_external_hash(req.block_hashes[split - 1])
    assert ev.block_hashes == [to_external_hash(h) for h in req.block_hashes[split:num_blocks]]
    assert ev.token_ids == list(range(split * BS, num_blocks * BS))


def test_cache_full_blocks_parent_hash_of_null_block():
    """The parent hash is the request's hash even when that position holds the null block."""
    pool = make_pool()
    req = FakeRequest("r", range(3 * BS), BS)
    (b,) = pool.get_new_blocks(1)
    table = [pool.null_block, pool.null_block, b]
    pool.cache_full_blocks(req, table, 2, 3, BS, 0)
    (ev,) = pool.take_events()
    assert ev.parent_block_hash == to_external_hash(req.block_hashes[1])
    assert ev.block_hashes == [to_external_hash(req.block_hashes[2])]


def test_cache_full_blocks_skips_null_blocks():
    """Null blocks in the range are not cached and not listed in the event."""
    pool = make_pool()
    req = FakeRequest("r", range(3 * BS), BS)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [pool.null_block, b, pool.null_block], 0, 3, BS, 0)
    assert pool.null_block.block_hash is None
    (ev,) = pool.take_events()
    assert ev.block_hashes == [to_external_hash(req.block_hashes[1])]
    assert ev.token_ids == list(range(3 * BS))


def test_cache_full_blocks_null_only_range_emits_nothing():
    """A range holding only null blocks caches nothing and emits no event."""
    pool = make_pool()
    req = FakeRequest("r", range(2 * BS), BS)
    pool.cache_full_blocks(req, [pool.null_block, pool.null_block], 0, 2, BS, 0)
    assert pool.take_events() == []
    assert list(pool.iter_cached_blocks()) == []


def test_cache_full_blocks_empty_range_emits_nothing():
    """An empty range (num_cached >= num_full) emits no event."""
    pool = make_pool()
    req = FakeRequest("r", range(2 * BS), BS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 2, 2, BS, 0)
    assert pool.take_events() == []


def test_cache_full_blocks_salt_in_first_block_extra_keys():
    """The stored event's extra keys carry the cache salt on the first block only."""
    pool = make_pool()
    req = FakeRequest("r", range(2 * BS), BS, cache_salt="s1")
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    (ev,) = pool.take_events()
    assert ev.extra_keys == [(None, "s1"), None]


def test_cache_full_blocks_group_idx_and_medium():
    """Events carry the caching group's index and the pool's medium."""
    pool = make_pool(medium="CPU")
    req = FakeRequest("r", range(BS), BS)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [b], 0, 1, BS, 3)
    (ev,) = pool.take_events()
    assert ev.group_idx == 3 and ev.medium == "CPU"
    assert pool.get_cached_block(req.block_hashes[0], [3]) == [b]
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None


def test_cache_full_blocks_coarse_block_uses_last_fine_hash():
    """A block of 2 hash blocks is keyed by the hash of its last hash block."""
    pool = BlockPool(6, True, 2, enable_kv_cache_events=True)
    req = FakeRequest("r", range(8), 2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, 4, 0)
    assert blocks[0].block_hash == make_block_hash_with_group_id(req.block_hashes[1], 0)
    assert blocks[1].block_hash == make_block_hash_with_group_id(req.block_hashes[3], 0)
    (ev,) = pool.take_events()
    assert ev.block_size == 4
    assert ev.token_ids == list(range(8))


def test_cache_already_cached_block_is_skipped():
    """Re-caching a block that already holds a hash keeps its hash and emits nothing."""
    pool = make_pool()
    req = FakeRequest("r", range(2 * BS), BS)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [a], 0, 1, BS, 0)
    key = a.block_hash
    pool.take_events()
    pool.cache_full_blocks(req, [a, b], 0, 2, BS, 0)
    assert a.block_hash == key
    (ev,) = pool.take_events()
    assert ev.block_hashes == [to_external_hash(req.block_hashes[1])]
    assert len(list(pool.iter_cached_blocks())) == 2


def test_cache_needs_enough_hashes():
    """Caching past the request's hashed blocks is an invariant error."""
    pool = make_pool()
    req = FakeRequest("r", range(BS + 1), BS)
    blocks = pool.get_new_blocks(2)
    with pytest.raises(InvariantError, match="block hashes"):
        pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)


def test_no_events_when_disabled():
    """With events disabled nothing is recorded."""
    pool = make_pool(events=False)
    req = FakeRequest("r", range(BS), BS)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [b], 0, 1, BS, 0)
    pool.evict_blocks([b.block_id])
    assert pool.take_events() == []


# -- lookup -------------------------------------------------------------------------


def test_get_cached_block_one_per_group():
    """A lookup over several groups returns one block per group."""
    pool = make_pool()
    req = FakeRequest("r", range(BS), BS)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [b0], 0, 1, BS, 0)
    pool.cache_full_blocks(req, [b1], 0, 1, BS, 1)
    assert pool.get_cached_block(req.block_hashes[0], [0, 1]) == [b0, b1]
    assert pool.get_cached_block(req.block_hashes[0], [1, 0]) == [b1, b0]


@pytest.mark.parametrize("gid", [255, 256, 1000])
def test_get_cached_block_high_group_ids(gid):
    """Group ids past the precomputed key suffixes are looked up like small ones."""
    pool = make_pool()
    req = FakeRequest("r", range(BS), BS)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [a], 0, 1, BS, gid)
    pool.cache_full_blocks(req, [b], 0, 1, BS, 0)
    assert pool.get_cached_block(req.block_hashes[0], [gid]) == [a]
    assert pool.get_cached_block(req.block_hashes[0], [0, gid]) == [b, a]
    assert pool.get_cached_block(req.block_hashes[0], [gid + 1]) is None


def test_get_cached_block_misses_if_any_group_misses():
    """A lookup returns None when one group lacks the hash."""
    pool = make_pool()
    req = FakeRequest("r", range(BS), BS)
    (b0,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [b0], 0, 1, BS, 0)
    assert pool.get_cached_block(req.block_hashes[0], [0, 1]) is None


def test_duplicate_hash_lookup_returns_first_cached():
    """Two blocks with the same hash are both kept; the first cached is returned."""
    pool = make_pool()
    req = FakeRequest("r", range(BS), BS)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, [a], 0, 1, BS, 0)
    pool.cache_full_blocks(req, [b], 0, 1, BS, 0)
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [a]
    assert set(pool.iter_cached_blocks()) == {a, b}
    pool.evict_blocks([a.block_id])
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [b]


def test_hash_map_pop_requires_matching_block_id():
    """BlockHashToBlockMap.pop removes an entry only when the block id matches."""
    m = BlockHashToBlockMap()
    a, b = KVCacheBlock(1), KVCacheBlock(2)
    m.insert(b"k", a)
    assert m.pop(b"k", 2) is None
    assert m.get_one_block(b"k") is a
    m.insert(b"k", b)
    assert m.pop(b"k", 1) is a
    assert m.get_one_block(b"k") is b
    assert m.pop(b"k", 2) is b
    assert b"k" not in m and len(m) == 0


# -- eviction -----------------------------------------------------------------------


def test_reusing_cached_block_emits_block_removed():
    """Allocating a free cached block evicts its hash and emits BlockRemoved."""
    pool = make_pool(3)  # usable blocks 1, 2
    req = FakeRequest("r", range(BS), BS)
    blocks = cache_at_positions(pool, req, [0], BS, group_id=2)
    pool.take_events()
    got = pool.get_new_blocks(2)
    assert blocks[0] in got
    assert blocks[0].block_hash is None
    assert pool.get_cached_block(req.block_hashes[0], [2]) is None
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockRemoved)
    assert ev.block_hashes == [to_external_hash(req.block_hashes[0])]
    assert ev.group_idx == 2 and ev.medium == "GPU"


def test_reusing_cached_block_without_events_forgets_its_hash():
    """With events off (the inlined path) a reused cached block also loses its hash.

    A stale hash would make the block look cached already, so caching its new
    contents would be skipped and a later request would miss them.
    """
    pool = make_pool(3, events=False)  # usable blocks 1, 2
    old = FakeRequest("old", range(BS), BS)
    cached = cache_at_positions(pool, old, [0], BS)[0]
    got = pool.get_new_blocks(2)
    assert cached in got and all(b.block_hash is None for b in got)
    assert pool.get_cached_block(old.block_hashes[0], [0]) is None
    new = FakeRequest("new", range(100, 100 + BS), BS)
    pool.cache_full_blocks(new, [cached], 0, 1, BS, 0)
    assert pool.get_cached_block(new.block_hashes[0], [0]) == [cached]


def test_uncached_reuse_emits_nothing():
    """Allocating never-cached blocks emits no event."""
    pool = make_pool(4)
    pool.get_new_blocks(3)
    assert pool.take_events() == []


def test_evict_blocks_drops_hash_and_emits():
    """evict_blocks removes the given blocks' hashes and emits one BlockRemoved each."""
    pool = make_pool()
    req = FakeRequest("r", range(2 * BS), BS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
    pool.take_events()
    pool.evict_blocks([blocks[1].block_id])
    assert blocks[1].block_hash is None and blocks[0].block_hash is not None
    assert blocks[1].ref_cnt == 1  # still allocated
    (ev,) = pool.take_events()
    assert ev == BlockRemoved(
        block_hashes=[to_external_hash(req.block_hashes[1])], medium="GPU", group_idx=0
    )


def test_evict_uncached_and_null_blocks_is_noop():
    """Evicting uncached blocks or the null block changes nothing and emits nothing."""
    pool = make_pool()
    (b,) = pool.get_new_blocks(1)
    pool.evict_blocks([0, b.block_id])
    assert pool.take_events() == []


# -- reset, usage, events ----------------------------------------------------------


def test_reset_prefix_cache_fails_while_blocks_in_use():
    """reset_prefix_cache returns False and changes nothing while a block is referenced."""
    pool = make_pool()
    req = FakeRequest("r", range(BS), BS)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [b], 0, 1, BS, 0)
    pool.take_events()
    assert pool.reset_prefix_cache() is False
    assert b.block_hash is not None
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [b]
    assert pool.take_events() == []


def test_reset_prefix_cache_clears_and_emits():
    """With every block free, reset_prefix_cache drops all hashes and emits AllBlocksCleared."""
    pool = make_pool()
    req = FakeRequest("r", range(3 * BS), BS)
    cache_at_positions(pool, req, [0, 1, 2], BS)
    pool.take_events()
    assert pool.reset_prefix_cache() is True
    assert list(pool.iter_cached_blocks()) == []
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_cached_block(req.block_hashes[0], [0]) is None
    assert pool.take_events() == [AllBlocksCleared(medium="GPU")]
    assert pool.get_num_free_blocks() == 10


def test_get_num_free_blocks_counts_evictable():
    """Cached blocks with ref 0 count as free."""
    pool = make_pool()
    req = FakeRequest("r", range(2 * BS), BS)
    cache_at_positions(pool, req, [0, 1], BS)
    assert pool.get_num_free_blocks() == 10


def test_get_usage_excludes_null_block():
    """Usage is the referenced fraction of the usable (non-null) blocks."""
    pool = make_pool(11)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(4)
    assert pool.get_usage() == pytest.approx(0.4)
    pool.get_new_blocks(6)
    assert pool.get_usage() == pytest.approx(1.0)
    pool.free_blocks(blocks)
    assert pool.get_usage() == pytest.approx(0.6)


def test_take_events_clears_queue():
    """take_events returns the recorded events once."""
    pool = make_pool()
    req = FakeRequest("r", range(BS), BS)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [b], 0, 1, BS, 0)
    assert len(pool.take_events()) == 1
    assert pool.take_events() == []


def test_block_hash_cannot_be_overwritten():
    """Setting a hash on a block that already has one raises."""
    b = KVCacheBlock(1)
    b.block_hash = b"x" * 36
    with pytest.raises(InvariantError):
        b.block_hash = b"y" * 36
    b.reset_hash()
    assert b.block_hash is None


def test_touch_on_half_linked_block_raises_and_leaves_neighbours_linked():
    """A block at ref count 0 whose back link is gone is reported as corrupt, and the
    block after it keeps pointing back at it (the queue is left as it was found)."""
    pool = make_pool(6)
    a, b, c = pool.get_new_blocks(3)
    pool.free_blocks([a, b, c])
    after = b.next_free_block
    b.prev_free_block = None  # corrupt: ref count 0, forward link only
    free = pool.get_num_free_blocks()
    with pytest.raises(InvariantError, match="not in the free queue"):
        pool.touch([b])
    assert after is not None and after.prev_free_block is b
    assert pool.get_num_free_blocks() == free


def test_null_block_is_never_counted_free_however_often_it_is_touched_and_freed():
    """The null block stays out of the free count through touch/free cycles."""
    pool = make_pool(4)
    free = pool.get_num_free_blocks()
    for _ in range(3):
        pool.touch([pool.null_block])
        pool.free_blocks([pool.null_block])
    pool.touch([pool.null_block, pool.null_block])
    assert pool.get_num_free_blocks() == free
    assert free_ids(pool) == [1, 2, 3]
