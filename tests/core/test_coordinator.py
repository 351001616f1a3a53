"""Tests for the KV cache coordinators (kv_cache/coordinator.py)."""

from __future__ import annotations

import pytest

from kvconnector_core.errors import BlockSizeError, ConfigError
from kvconnector_core.kv_cache.coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    check_block_sizes,
    get_kv_cache_coordinator,
)
from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig, KVCacheGroupSpec

from _core_helpers import FakeRequest, cache_at_positions, full_spec, swa_spec


def coordinator(specs, *, sched, hash_bs=2, num_blocks=64, caching=True, mml=1024, mnbt=16):
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)],
    )
    return get_kv_cache_coordinator(
        cfg,
        mml,
        mnbt,
        scheduler_block_size=sched,
        hash_block_size=hash_bs,
        enable_caching=caching,
        enable_kv_cache_events=False,
    )


# -- block size checks ---------------------------------------------------------------------


def test_scheduler_not_multiple_of_hash_block_size():
    """scheduler_block_size must be a multiple of hash_block_size; the error names the numbers."""
    with pytest.raises(
        BlockSizeError, match=r"scheduler_block_size 6 .* hash_block_size 4"
    ) as info:
        check_block_sizes(6, 4, [2])
    assert isinstance(info.value, ValueError) and isinstance(info.value, ConfigError)
    assert (
        info.value.scheduler_block_size,
        info.value.hash_block_size,
        info.value.group_block_sizes,
    ) == (6, 4, (2,))


def test_scheduler_not_multiple_of_group_block_size():
    """scheduler_block_size must be a multiple of every group's block size."""
    with pytest.raises(ValueError, match=r"scheduler_block_size 8 .* group block size 16"):
        check_block_sizes(8, 4, [4, 16])


def test_group_block_size_not_multiple_of_hash_block_size():
    """Each group block size must be a multiple of hash_block_size."""
    with pytest.raises(BlockSizeError, match="group block size 6"):
        check_block_sizes(12, 4, [6])


@pytest.mark.parametrize("sched,hash_bs", [(0, 1), (4, 0)])
def test_non_positive_sizes_rejected(sched, hash_bs):
    """Zero block sizes are rejected."""
    with pytest.raises(BlockSizeError):
        check_block_sizes(sched, hash_bs, [])


@pytest.mark.parametrize(
    "sched,hash_bs,groups", [(4, 4, [4]), (16, 4, [4, 8, 16]), (12, 2, [4, 6])]
)
def test_valid_block_sizes_accepted(sched, hash_bs, groups):
    """Consistent block sizes pass the check."""
    check_block_sizes(sched, hash_bs, groups)


def test_coordinator_construction_checks_block_sizes():
    """Building a coordinator with a bad scheduler block size raises BlockSizeError."""
    with pytest.raises(BlockSizeError, match="scheduler_block_size 6"):
        coordinator([full_spec(4)], sched=6, hash_bs=2)


def test_scheduler_block_size_passed_to_every_manager():
    """The coordinator stores the scheduler block size and hands it to every manager."""
    c = coordinator([full_spec(2), swa_spec(4, 8)], sched=8)
    assert c.scheduler_block_size == 8
    assert [m.scheduler_block_size for m in c.single_type_managers] == [8, 8]
    assert [m.kv_cache_group_id for m in c.single_type_managers] == [0, 1]


# -- selection -------------------------------------------------------------------------------


def test_selects_no_prefix_cache_when_caching_disabled():
    """Caching off picks the no-prefix-cache coordinator, which always misses."""
    c = coordinator([full_spec(2)], sched=2, caching=False)
    assert type(c) is KVCacheCoordinatorNoPrefixCache
    req = FakeRequest("r", range(8), 2)
    assert c.find_longest_cache_hit(req.block_hashes, 7) == (([],), 0)


def test_selects_unitary_for_one_group():
    """One group picks the unitary coordinator."""
    assert type(coordinator([full_spec(2)], sched=2)) is UnitaryKVCacheCoordinator


def test_selects_hybrid_for_several_groups():
    """Several groups pick the hybrid coordinator."""
    assert type(coordinator([full_spec(2), swa_spec(2, 4)], sched=2)) is HybridKVCacheCoordinator


def test_unitary_hit_aligned_to_scheduler_block_size():
    """The unitary coordinator aligns hits to the scheduler block size."""
    c = coordinator([full_spec(2)], sched=4)
    req = FakeRequest("r", range(12), 2)
    cache_at_positions(c.block_pool, req, range(5), 2)
    (blocks,), n = c.find_longest_cache_hit(req.block_hashes, 11)
    assert n == 8 and len(blocks) == 4


# -- hybrid: full + sliding window -------------------------------------------------------------


@pytest.fixture
def hybrid():
    """Full attention + SWA (sw=4), bs=2 both, with a 20-token sequence cached in both groups."""
    c = coordinator([full_spec(2), swa_spec(2, 4)], sched=2)
    req = FakeRequest("r", range(20), 2)
    full_blocks = cache_at_positions(c.block_pool, req, range(10), 2, group_id=0)
    swa_blocks = cache_at_positions(c.block_pool, req, range(10), 2, group_id=1)
    return c, req, full_blocks, swa_blocks


def test_hybrid_all_cached(hybrid):
    """With everything cached the hit is the full max length; SWA keeps only its window."""
    c, req, fb, sb = hybrid
    (full, swa), n = c.find_longest_cache_hit(req.block_hashes, 19)
    assert n == 18
    assert full == [fb[i] for i in range(9)]
    null = c.block_pool.null_block
    assert swa == [null] * 7 + [sb[7], sb[8]]


def test_hybrid_swa_eviction_at_the_end_shrinks_hit(hybrid):
    """Evicting the SWA block at the end of the hit shrinks the hit to the next full window."""
    c, req, fb, sb = hybrid
    c.block_pool.evict_blocks([sb[8].block_id])
    (full, swa), n = c.find_longest_cache_hit(req.block_hashes, 19)
    assert n == 16
    assert len(full) == 8 and swa[-2:] == [sb[6], sb[7]]


def test_hybrid_swa_eviction_outside_window_keeps_hit(hybrid):
    """Evicting an SWA block left of the window does not shrink the hit."""
    c, req, fb, sb = hybrid
    c.block_pool.evict_blocks([sb[2].block_id])
    _, n = c.find_longest_cache_hit(req.block_hashes, 19)
    assert n == 18


def test_hybrid_swa_evictions_find_earlier_window(hybrid):
    """Evicting SWA blocks 7 and 5 leaves the window at blocks 3-4: hit 10 tokens."""
    c, req, fb, sb = hybrid
    c.block_pool.evict_blocks([sb[7].block_id, sb[5].block_id])
    (full, swa), n = c.find_longest_cache_hit(req.block_hashes, 19)
    assert n == 10
    assert full == [fb[i] for i in range(5)]
    assert swa[3:] == [sb[3], sb[4]] and len(swa) == 5


def test_hybrid_full_eviction_bounds_swa(hybrid):
    """Evicting a full-attention block cuts the hit there; SWA is looked up again at that length."""
    c, req, fb, sb = hybrid
    c.block_pool.evict_blocks([fb[4].block_id])
    (full, swa), n = c.find_longest_cache_hit(req.block_hashes, 19)
    assert n == 8
    assert full == [fb[i] for i in range(4)]
    null = c.block_pool.null_block
    assert swa == [null, null, sb[2], sb[3]]


def test_hybrid_swa_miss_everywhere_gives_no_hit(hybrid):
    """With no SWA block cached at all, the hybrid hit is 0 whatever full attention has."""
    c, req, fb, sb = hybrid
    c.block_pool.evict_blocks([b.block_id for b in sb.values()])
    (full, swa), n = c.find_longest_cache_hit(req.block_hashes, 19)
    assert n == 0 and full == [] and swa == []


def test_hybrid_later_window_shrink_rescans_earlier_windows():
    """A later sliding-window group that shrinks the hit makes an earlier one look again at
    the shorter length: its window there must hold real blocks, not the nulls its first
    (longer) lookup left in front of its old window."""
    c = coordinator([full_spec(2), swa_spec(2, 4), swa_spec(2, 8)], sched=2)
    req = FakeRequest("r", range(20), 2)
    cache_at_positions(c.block_pool, req, range(10), 2, group_id=0)
    small = cache_at_positions(c.block_pool, req, range(10), 2, group_id=1)
    large = cache_at_positions(c.block_pool, req, range(10), 2, group_id=2)
    c.block_pool.evict_blocks([large[7].block_id])  # the wide window now ends at block 6
    (full, swa_small, swa_large), n = c.find_longest_cache_hit(req.block_hashes, 19)
    assert n == 14
    assert len(full) == len(swa_small) == len(swa_large) == 7
    # Token 14 reads tokens 11..13 (window 4) and 7..13 (window 8).
    assert swa_small[5:7] == [small[5], small[6]]
    assert swa_large[3:7] == [large[i] for i in range(3, 7)]


def test_hybrid_hit_aligned_to_scheduler_block_size():
    """The hybrid hit is a multiple of scheduler_block_size, and lists are cut per group block
    size."""
    c = coordinator([full_spec(4), swa_spec(2, 4)], sched=4, hash_bs=2)
    req = FakeRequest("r", range(20), 2)
    fb = cache_at_positions(c.block_pool, req, range(5), 4, group_id=0)
    cache_at_positions(c.block_pool, req, range(10), 2, group_id=1)
    (full, swa), n = c.find_longest_cache_hit(req.block_hashes, 19)
    assert n == 16
    assert full == [fb[i] for i in range(4)]
    assert len(swa) == 8


def test_hybrid_equal_specs_must_all_hit():
    """Two groups with the same spec are looked up together: both must hold a block."""
    c = coordinator([full_spec(2), full_spec(2), swa_spec(2, 4)], sched=2)
    req = FakeRequest("r", range(12), 2)
    cache_at_positions(c.block_pool, req, range(6), 2, group_id=0)
    cache_at_positions(c.block_pool, req, range(3), 2, group_id=1)
    cache_at_positions(c.block_pool, req, range(6), 2, group_id=2)
    (f0, f1, swa), n = c.find_longest_cache_hit(req.block_hashes, 11)
    assert n == 6
    assert len(f0) == len(f1) == 3 and len(swa) == 3


def test_hybrid_aligned_swa_hit_keeps_window_after_eviction():
    """With sched=4 and SWA bs=2, evicting SWA block 7 gives a 12-token hit whose window blocks are
    real."""
    c = coordinator([full_spec(2), swa_spec(2, 4)], sched=4)
    req = FakeRequest("r", range(20), 2)
    cache_at_positions(c.block_pool, req, range(10), 2, group_id=0)
    sb = cache_at_positions(c.block_pool, req, range(10), 2, group_id=1)
    c.block_pool.evict_blocks([sb[7].block_id])
    (full, swa), n = c.find_longest_cache_hit(req.block_hashes, 19)
    assert n == 12
    # Token 12 reads tokens 9..11 -> SWA blocks 4 and 5 must be real.
    assert swa[4:6] == [sb[4], sb[5]]


def test_unitary_aligned_swa_hit_keeps_window():
    """A single SWA group with sched=4, bs=2: the aligned hit's window blocks are all real."""
    c = coordinator([swa_spec(2, 4)], sched=4)
    req = FakeRequest("r", range(20), 2)
    sb = cache_at_positions(c.block_pool, req, range(10), 2)
    c.block_pool.evict_blocks([sb[7].block_id])
    (swa,), n = c.find_longest_cache_hit(req.block_hashes, 19)
    assert n == 12  # non-empty: an empty hit would pass the window check vacuously
    # The next token n reads tokens n-3..n-1: their blocks must not be null.
    assert swa[4:] == [sb[4], sb[5]]
    assert all(not b.is_null for b in swa[(n - 3) // 2 :]), (n, swa)


# -- allocation across groups ------------------------------------------------------------------


def test_coordinator_allocates_per_group_from_shared_pool():
    """Each group gets its own blocks from the one shared pool; the need is summed."""
    c = coordinator([full_spec(2), swa_spec(2, 4)], sched=2, num_blocks=20)
    empty = ([], [])
    assert c.get_num_blocks_to_allocate("r", 8, empty, 0) == 8
    new = c.allocate_new_blocks("r", 8, 0)
    assert [len(g) for g in new] == [4, 4]
    assert not {b.block_id for b in new[0]} & {b.block_id for b in new[1]}
    assert c.block_pool.get_num_free_blocks() == 19 - 8
    c.free("r")
    assert c.block_pool.get_num_free_blocks() == 19
