"""Tests for the per-attention-type managers (kv_cache/single_type_manager.py)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.block_pool import BlockPool
from kvconnector_core.kv_cache.kv_cache_spec import KVCacheSpec, cdiv
from kvconnector_core.kv_cache.single_type_manager import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    SlidingWindowManager,
    get_manager_for_kv_cache_spec,
)

from _core_helpers import (
    FakeRequest,
    cache_at_positions,
    chunked_spec,
    full_spec,
    make_request,
    swa_spec,
)

BS = 2


def ids(blocks):
    return [b.block_id for b in blocks]


def pool_with(positions, n_tokens=24, *, num_blocks=40, group=0, bs=BS):
    """A pool whose cache holds the blocks of one token sequence at ``positions``."""
    pool = BlockPool(num_blocks, True, BS, enable_kv_cache_events=True)
    req = FakeRequest("seed", range(n_tokens), BS)
    placed = cache_at_positions(pool, req, positions, bs, group)
    return pool, req, placed


def manager(spec, pool, *, mnbt=16, mml=1024, sched=None, gid=0):
    return get_manager_for_kv_cache_spec(
        spec,
        mnbt,
        mml,
        block_pool=pool,
        kv_cache_group_id=gid,
        scheduler_block_size=sched or spec.block_size,
    )


# -- full attention: longest hit ----------------------------------------------------------


def test_full_attention_hit_all_cached():
    """Full attention returns every cached block up to max_length."""
    pool, req, placed = pool_with(range(5))
    (hit,) = FullAttentionManager.find_longest_cache_hit(
        req.block_hashes, 11, [0], pool, full_spec(BS), BS
    )
    assert ids(hit) == [placed[i].block_id for i in range(5)]


def test_full_attention_hit_stops_at_first_miss():
    """Full attention stops at the first miss even if later blocks are cached."""
    pool, req, placed = pool_with([0, 1, 3, 4])
    (hit,) = FullAttentionManager.find_longest_cache_hit(
        req.block_hashes, 11, [0], pool, full_spec(BS), BS
    )
    assert ids(hit) == [placed[0].block_id, placed[1].block_id]


def test_full_attention_hit_limited_by_max_length():
    """Only whole blocks within max_length are hits."""
    pool, req, _ = pool_with(range(8))
    (hit,) = FullAttentionManager.find_longest_cache_hit(
        req.block_hashes, 7, [0], pool, full_spec(BS), BS
    )
    assert len(hit) == 3


def test_full_attention_hit_aligned_down():
    """The hit is rounded down to the alignment."""
    pool, req, _ = pool_with(range(5))
    (hit,) = FullAttentionManager.find_longest_cache_hit(
        req.block_hashes, 11, [0], pool, full_spec(BS), 8
    )
    assert len(hit) == 4
    (hit,) = FullAttentionManager.find_longest_cache_hit(
        req.block_hashes, 11, [0], pool, full_spec(BS), 6
    )
    assert len(hit) == 3


def test_full_attention_first_block_miss_is_empty():
    """A miss on the first block means no hit at all."""
    pool, req, _ = pool_with([1, 2, 3])
    (hit,) = FullAttentionManager.find_longest_cache_hit(
        req.block_hashes, 11, [0], pool, full_spec(BS), BS
    )
    assert hit == []


def test_full_attention_hit_needs_every_group():
    """With several group ids a block is a hit only if every group has it."""
    pool = BlockPool(40, True, BS)
    req = FakeRequest("seed", range(12), BS)
    cache_at_positions(pool, req, range(4), BS, group_id=0)
    cache_at_positions(pool, req, range(2), BS, group_id=1)
    h0, h1 = FullAttentionManager.find_longest_cache_hit(
        req.block_hashes, 11, [0, 1], pool, full_spec(BS), BS
    )
    assert len(h0) == len(h1) == 2
    assert {b.block_hash[-4:] for b in h1} == {(1).to_bytes(4, "big")}


@pytest.mark.parametrize(
    "manager_cls, spec",
    [
        (FullAttentionManager, full_spec(2 * BS)),
        (SlidingWindowManager, swa_spec(2 * BS, 6)),
    ],
)
def test_coarse_block_hit_is_bounded_by_the_hashed_tokens(manager_cls, spec):
    """With blocks of two hash blocks, a max_length past the hashed tokens still hits
    only the blocks the hashes cover (no read past the request's hashes)."""
    pool, req, placed = pool_with(range(6), n_tokens=24, bs=2 * BS)  # 12 hashes, 6 coarse blocks
    (hit,) = manager_cls.find_longest_cache_hit(req.block_hashes, 100, [0], pool, spec, 2 * BS)
    assert len(hit) == 6
    assert hit[-1] is placed[5]


# -- sliding window: right-to-left hit --------------------------------------------------------


def swa_hit(positions, max_length, sw=4, align=BS):
    pool, req, placed = pool_with(positions)
    (hit,) = SlidingWindowManager.find_longest_cache_hit(
        req.block_hashes, max_length, [0], pool, swa_spec(BS, sw), align
    )
    return pool, placed, hit


def test_sliding_window_hit_takes_last_window():
    """With everything cached, only the last cdiv(sw-1, bs) blocks are real; the rest are null."""
    pool, placed, hit = swa_hit(range(6), 11, sw=4)  # need = 2 blocks, max 5 blocks
    assert len(hit) == 5
    assert hit[:3] == [pool.null_block] * 3
    assert hit[3:] == [placed[3], placed[4]]


def test_sliding_window_hit_right_to_left_skips_gaps():
    """The right-most run of cdiv(sw-1, bs) cached blocks wins, even after a miss."""
    pool, placed, hit = swa_hit([0, 1, 2, 4], 11, sw=4)
    assert len(hit) == 3
    assert hit == [pool.null_block, placed[1], placed[2]]


def test_sliding_window_no_full_window_uses_run_from_zero():
    """Without a full window run, the hit is the run starting at position 0."""
    pool, placed, hit = swa_hit([0, 2, 4], 11, sw=4)
    assert hit == [placed[0]]


def test_sliding_window_nothing_cached():
    """No cached block means no hit."""
    _, _, hit = swa_hit([], 11, sw=4)
    assert hit == []


def test_sliding_window_larger_window_needs_longer_run():
    """A window of 7 tokens with bs 2 needs 3 consecutive blocks."""
    pool, placed, hit = swa_hit([0, 1, 2, 3, 5, 6, 8, 9], 21, sw=7)
    assert len(hit) == 4
    assert hit[0] is pool.null_block
    assert hit[1:] == [placed[1], placed[2], placed[3]]


def test_sliding_window_aligned_hit_keeps_whole_window():
    """With alignment > block size, the hit's window blocks are all real (vLLM aligns the run's
    end).

    The run 2..4 ends at token 10, which is not aligned to 4: the hit is cut to 8 tokens,
    whose window (the next token 8 reads tokens 4..7) is blocks 2 and 3, both cached.
    """
    pool, placed, hit = swa_hit([2, 3, 4], 11, sw=5, align=4)
    sw = 5
    n = len(hit) * BS
    assert n == 8  # non-empty: an empty hit would pass the checks below vacuously
    assert hit == [pool.null_block, pool.null_block, placed[2], placed[3]]
    first_needed = max(0, n - sw + 1) // BS
    assert all(not b.is_null for b in hit[first_needed:])


def test_sliding_window_aligned_hit_is_empty_without_a_real_aligned_window():
    """Only blocks 3..4 cached: no aligned end has its whole window cached, so no hit."""
    _, _, hit = swa_hit([3, 4], 11, sw=5, align=4)
    assert hit == []


@settings(max_examples=150, deadline=None)
@given(
    cached=st.sets(st.integers(0, 10), max_size=11),
    max_length=st.integers(0, 23),
    sw=st.integers(1, 9),
    align_blocks=st.sampled_from([1, 2]),
)
def test_sliding_window_hit_is_usable(cached, max_length, sw, align_blocks):
    """Every SWA hit is aligned, within max_length, made of real cached blocks where the next token
    reads."""
    align = align_blocks * BS
    pool, placed, hit = swa_hit(cached, max_length, sw=sw, align=align)
    n = len(hit) * BS
    assert n <= max_length and n % align == 0
    for i, b in enumerate(hit):
        assert b.is_null or placed[i] is b
    if align_blocks == 1:  # align > bs: see test_sliding_window_aligned_hit_keeps_whole_window
        first_needed = max(0, n - sw + 1) // BS
        assert all(not b.is_null for b in hit[first_needed:])


# -- chunked local -------------------------------------------------------------------------------


def chunked_hit(positions, max_length, chunk=4):
    pool, req, placed = pool_with(positions)
    (hit,) = ChunkedLocalAttentionManager.find_longest_cache_hit(
        req.block_hashes, max_length, [0], pool, chunked_spec(BS, chunk), BS
    )
    return pool, placed, hit


def test_chunked_blocks_before_current_chunk_are_null_hits():
    """Blocks before the chunk containing max_length count as (null) hits without a lookup."""
    pool, placed, hit = chunked_hit([], 11, chunk=4)
    assert hit == [pool.null_block] * 4


def test_chunked_scans_current_chunk_forward():
    """Inside the current chunk the hit extends over cached blocks until a miss."""
    # chunk starts at 8 -> block 4; max 6 blocks
    pool, placed, hit = chunked_hit([4, 5], 13, chunk=8)
    assert hit[:4] == [pool.null_block] * 4
    assert hit[4:] == [placed[4], placed[5]]
    pool, placed, hit = chunked_hit([5], 13, chunk=8)
    assert hit == [pool.null_block] * 4


def test_chunked_first_chunk_behaves_like_full_attention():
    """Inside the first chunk the hit is a plain prefix scan."""
    pool, placed, hit = chunked_hit([0, 1, 3], 7, chunk=8)
    assert hit == [placed[0], placed[1]]


def test_chunked_hit_is_aligned_down():
    """A chunked-local hit is trimmed to the alignment like the other attention types."""
    pool, req, placed = pool_with([4])
    (hit,) = ChunkedLocalAttentionManager.find_longest_cache_hit(
        req.block_hashes, 11, [0], pool, chunked_spec(BS, 8), 2 * BS
    )  # null hits for blocks 0-3, block 4 cached: 5 blocks, aligned down to 4
    assert hit == [pool.null_block] * 4


def test_chunked_null_hits_are_bounded_by_the_hashed_tokens():
    """Null hits before the current chunk never reach past the blocks the hashes cover."""
    pool, req, _ = pool_with([], n_tokens=24, bs=2 * BS)  # 12 hashes, 6 coarse blocks
    (hit,) = ChunkedLocalAttentionManager.find_longest_cache_hit(
        req.block_hashes, 100, [0], pool, chunked_spec(2 * BS, 64), 2 * BS
    )
    assert hit == [pool.null_block] * 6


# -- get_num_blocks_to_allocate ------------------------------------------------------------------


def test_num_blocks_to_allocate_counts_evictable_hits():
    """Hits at ref 0 cost a free block each (touching takes them out of the free queue)."""
    pool, req, placed = pool_with(range(5))
    m = manager(full_spec(BS), pool)
    hits = [placed[i] for i in range(5)]
    assert m.get_num_blocks_to_allocate("r", 20, hits, 10) == 10
    pool.touch(hits)
    assert m.get_num_blocks_to_allocate("r", 20, hits, 10) == 5


def test_num_blocks_to_allocate_for_running_request():
    """A running request needs only the blocks beyond those it holds."""
    pool = BlockPool(20, True, BS)
    m = manager(full_spec(BS), pool)
    m.allocate_new_blocks("r", 6, 0)
    assert m.get_num_blocks_to_allocate("r", 6, [], 6) == 0
    assert m.get_num_blocks_to_allocate("r", 7, [], 6) == 1


@pytest.mark.parametrize(
    "spec",
    [full_spec(BS), swa_spec(BS, 64), chunked_spec(BS, 64)],
    ids=["full", "sliding", "chunked"],
)
def test_num_blocks_to_allocate_is_never_negative(spec):
    """A request holding more blocks than ``num_tokens`` needs asks for none, never for a
    negative number (a coordinator sums the groups: a negative would hide another group's need)."""
    pool = BlockPool(20, True, BS)
    m = manager(spec, pool)
    m.allocate_new_blocks("r", 4 * BS, 0)
    assert m.get_num_blocks_to_allocate("r", 3 * BS, [], 0) == 0
    assert m.get_num_blocks_to_allocate("r", 2 * BS, [], 0) == 0


def test_num_blocks_to_allocate_with_admission_cap():
    """The admission cap clamps the requirement only when apply_admission_cap is set."""
    pool = BlockPool(20, True, BS)
    m = manager(swa_spec(BS, 4), pool, mnbt=4, mml=1000)
    cap = m.max_admission_blocks_per_request
    assert cap == cdiv(min(4 - 1 + 4, 1000), BS) + 1 == 5
    assert m.get_num_blocks_to_allocate("r", 100, [], 0) == 50
    assert m.get_num_blocks_to_allocate("r", 100, [], 0, apply_admission_cap=True) == 5


def test_num_blocks_to_allocate_full_attention_has_no_cap():
    """Full attention ignores apply_admission_cap (its cap is None)."""
    pool = BlockPool(20, True, BS)
    m = manager(full_spec(BS), pool, mml=1000)
    assert m.max_admission_blocks_per_request is None
    assert m.get_num_blocks_to_allocate("r", 100, [], 0, apply_admission_cap=True) == 50


def test_num_blocks_to_allocate_sliding_window_skips_out_of_window():
    """SWA needs no blocks for positions before the window; null hits are free."""
    pool, req, placed = pool_with(range(5))
    m = manager(swa_spec(BS, 4), pool)
    hits = [pool.null_block] * 3 + [placed[3], placed[4]]
    # 12 tokens -> 6 blocks; 5 covered by hits; skipped = 10 - 4 + 1 = 7 tokens -> 3 blocks.
    # 1 new block + 2 evictable hits.
    assert m.get_num_blocks_to_allocate("r", 12, hits, 10) == 3
    # Far-ahead computed tokens: only the window's blocks are new.
    assert m.get_num_blocks_to_allocate("r", 40, [], 36) == 20 - 16


def test_num_blocks_to_allocate_matches_allocation():
    """The predicted count equals the number of blocks allocate_new_blocks takes from the pool."""
    pool = BlockPool(40, True, BS)
    m = manager(swa_spec(BS, 4), pool)
    for num_tokens, computed in [(8, 0), (16, 8), (30, 16)]:
        predicted = m.get_num_blocks_to_allocate("r", num_tokens, [], computed)
        free_before = pool.get_num_free_blocks()
        m.remove_skipped_blocks("r", computed)
        freed = pool.get_num_free_blocks() - free_before
        new = m.allocate_new_blocks("r", num_tokens, computed)
        assert len(new) == predicted
        assert freed >= 0


# -- allocation, caching, freeing --------------------------------------------------------------


def test_allocate_new_blocks_nulls_for_skipped_positions():
    """A fresh SWA allocation far into the sequence puts the null block before the window."""
    pool = BlockPool(20, True, BS)
    m = manager(swa_spec(BS, 4), pool)
    new = m.allocate_new_blocks("r", 12, 10)  # skipped 7 tokens -> 3 null blocks
    table = m.get_blocks("r")
    assert table[:3] == [pool.null_block] * 3
    assert table[3:] == new and len(new) == 3


def test_save_new_computed_blocks_touches_and_marks_cached():
    """Saving hits takes a reference on each and resumes caching after them."""
    pool, req, placed = pool_with(range(3))
    m = manager(full_spec(BS), pool)
    hits = [placed[i] for i in range(3)]
    m.save_new_computed_blocks("r", hits)
    assert [b.ref_cnt for b in hits] == [1, 1, 1]
    assert m.num_cached_block["r"] == 3
    assert m.get_blocks("r") == hits


def test_cache_blocks_caches_full_blocks_once():
    """cache_blocks caches each full block once, with the group id and spec kind in the event."""
    pool = BlockPool(20, True, BS, enable_kv_cache_events=True)
    m = manager(swa_spec(BS, 4), pool, gid=1)
    req = make_request("r", range(7), BS)
    m.allocate_new_blocks("r", 7, 0)
    m.cache_blocks(req, 7)
    (ev,) = pool.take_events()
    assert len(ev.block_hashes) == 3
    assert ev.group_idx == 1
    assert ev.kv_cache_spec_kind == "sliding_window" and ev.kv_cache_spec_sliding_window == 4
    m.cache_blocks(req, 7)
    assert pool.take_events() == []
    assert m.num_cached_block["r"] == 3


def test_cache_blocks_limited_by_hashes():
    """Only blocks that have a hash are cached, whatever num_tokens says."""
    pool = BlockPool(20, True, BS)
    m = manager(full_spec(BS), pool)
    req = make_request("r", range(5), BS)
    m.allocate_new_blocks("r", 8, 0)
    m.cache_blocks(req, 8)
    assert m.num_cached_block["r"] == 2
    assert [b.block_hash is not None for b in m.get_blocks("r")] == [True, True, False, False]


def test_free_releases_in_reverse_order():
    """free() releases a request's blocks tail first, so chain tails are evicted first."""
    pool = BlockPool(10, True, BS)
    m = manager(full_spec(BS), pool)
    req = make_request("r", range(6), BS)
    blocks = m.allocate_new_blocks("r", 6, 0)
    m.cache_blocks(req, 6)
    m.free("r")
    order = [b.block_id for b in pool.free_block_queue]
    assert order[-3:] == [blocks[2].block_id, blocks[1].block_id, blocks[0].block_id]
    assert m.get_blocks("r") == [] and "r" not in m.num_cached_block


def test_free_uncached_blocks_reused_first_tail_first():
    """Freed uncached blocks go to the front, the request's last block first."""
    pool = BlockPool(10, True, BS)
    m = manager(full_spec(BS), pool)
    blocks = m.allocate_new_blocks("r", 6, 0)
    m.free("r")
    assert [b.block_id for b in pool.free_block_queue][:3] == [b.block_id for b in reversed(blocks)]


# -- remove_skipped_blocks --------------------------------------------------------------------


@pytest.mark.parametrize("n,freed", [(4, 0), (5, 1), (6, 1), (7, 2), (11, 4)])
def test_sliding_window_remove_skipped_blocks(n, freed):
    """With sw=4, bs=2: n=5 frees block 0, n=7 frees blocks 0-1, n=11 frees blocks 0-3."""
    pool = BlockPool(20, True, BS)
    m = manager(swa_spec(BS, 4), pool)
    blocks = m.allocate_new_blocks("r", 16, 0)
    free_before = pool.get_num_free_blocks()
    m.remove_skipped_blocks("r", n)
    table = m.get_blocks("r")
    assert table[:freed] == [pool.null_block] * freed
    assert table[freed:] == blocks[freed:]
    assert pool.get_num_free_blocks() == free_before + freed
    assert all(b.ref_cnt == 0 for b in blocks[:freed])


def test_remove_skipped_blocks_is_incremental():
    """A second call frees only the newly skipped blocks, freeing them tail first."""
    pool = BlockPool(20, True, BS)
    m = manager(swa_spec(BS, 4), pool)
    blocks = m.allocate_new_blocks("r", 16, 0)
    m.remove_skipped_blocks("r", 7)
    m.remove_skipped_blocks("r", 11)
    front = [b.block_id for b in pool.free_block_queue][:4]
    assert front == [blocks[3].block_id, blocks[2].block_id, blocks[1].block_id, blocks[0].block_id]


def test_remove_skipped_blocks_stops_at_first_null():
    """Walking backwards stops at the first null block (everything before was released)."""
    pool = BlockPool(20, True, BS)
    m = manager(swa_spec(BS, 4), pool)
    blocks = m.allocate_new_blocks("r", 16, 0)
    m.req_to_blocks["r"][1] = pool.null_block
    pool.free_blocks([blocks[1]])
    m.remove_skipped_blocks("r", 11)  # skipped positions 0..3
    table = m.get_blocks("r")
    assert table[0] is blocks[0]  # left of the null: untouched
    assert table[1:4] == [pool.null_block] * 3
    assert blocks[0].ref_cnt == 1


def test_chunked_remove_skipped_blocks():
    """Chunked local frees every block before the current chunk."""
    pool = BlockPool(20, True, BS)
    m = manager(chunked_spec(BS, 4), pool)
    blocks = m.allocate_new_blocks("r", 16, 0)
    m.remove_skipped_blocks("r", 3)
    assert m.get_blocks("r") == blocks
    m.remove_skipped_blocks("r", 9)  # chunk [8, 12) -> 8 tokens skipped -> 4 blocks
    assert m.get_blocks("r")[:4] == [pool.null_block] * 4
    assert m.get_blocks("r")[4:] == blocks[4:]


def test_full_attention_never_skips():
    """Full attention keeps every block whatever the progress."""
    pool = BlockPool(20, True, BS)
    m = manager(full_spec(BS), pool)
    blocks = m.allocate_new_blocks("r", 16, 0)
    m.remove_skipped_blocks("r", 15)
    assert m.get_blocks("r") == blocks


@pytest.mark.parametrize(
    "n,skipped",
    [(0, 0), (3, 0), (4, 1), (10, 7)],
)
def test_sliding_window_num_skipped_tokens(n, skipped):
    """Skipped tokens are max(0, n - sw + 1)."""
    m = manager(swa_spec(BS, 4), BlockPool(4, True, BS))
    assert m.get_num_skipped_tokens(n) == skipped


# -- factory ------------------------------------------------------------------------------------


def test_factory_caps_and_classes():
    """The factory picks the manager class and computes the cap for SWA / chunked, None for full."""
    pool = BlockPool(8, True, BS)
    f = manager(full_spec(BS), pool, mnbt=16, mml=1000, sched=4)
    s = manager(swa_spec(BS, 10), pool, mnbt=16, mml=1000, sched=4)
    c = manager(chunked_spec(BS, 32), pool, mnbt=16, mml=1000, sched=4)
    assert type(f) is FullAttentionManager and f.max_admission_blocks_per_request is None
    assert type(s) is SlidingWindowManager
    assert s.max_admission_blocks_per_request == cdiv(min(10 - 1 + 16, 1000), BS) + 1
    assert type(c) is ChunkedLocalAttentionManager
    assert c.max_admission_blocks_per_request == cdiv(min(32 + 16, 1000), BS)
    assert f.scheduler_block_size == s.scheduler_block_size == c.scheduler_block_size == 4


def test_factory_unknown_spec_is_config_error():
    """A spec type without a manager raises ConfigError naming it."""

    @dataclasses.dataclass(frozen=True)
    class OddSpec(KVCacheSpec):
        pass

    with pytest.raises(ConfigError, match="OddSpec"):
        manager(OddSpec(block_size=BS), BlockPool(4, True, BS))
