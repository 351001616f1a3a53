"""Tests for the scheduler-facing KVCacheManager (kv_cache/kv_cache_manager.py)."""

from __future__ import annotations

import pytest

from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.block_pool import BlockPool
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
from kvconnector_core.kv_cache.kv_cache_spec import cdiv
from kvconnector_core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, to_external_hash

from _core_helpers import full_spec, make_manager, make_request, swa_spec


def free_ids(m):
    return [b.block_id for b in m.block_pool.free_block_queue]


def run_prefill(m, req):
    """Look up, allocate and compute a request's whole prompt in one step."""
    hit, n = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - n, n, hit)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return hit, n, new


# -- get_computed_blocks ---------------------------------------------------------------------


def test_last_token_is_always_recomputed():
    """A fully cached prompt of whole blocks hits all but its last block."""
    m = make_manager([full_spec(4)], 20)
    a = make_request("a", range(12), 4)
    run_prefill(m, a)
    m.free(a)
    b = make_request("b", range(12), 4)
    hit, n = m.get_computed_blocks(b)
    assert n == 8
    assert len(hit.blocks[0]) == 2


def test_no_hit_with_caching_disabled():
    """With caching disabled every lookup misses and nothing is cached."""
    m = make_manager([full_spec(4)], 20, enable_caching=False)
    a = make_request("a", range(12), 4)
    run_prefill(m, a)
    assert list(m.block_pool.iter_cached_blocks()) == []
    m.free(a)
    hit, n = m.get_computed_blocks(make_request("b", range(12), 4))
    assert n == 0 and hit.blocks == ([],)


def test_prefill_matches_vllm():
    """Two requests sharing 3 blocks: ids, ref counts and the free order [5,4,6..10,3,2,1] (vLLM
    test_prefill)."""
    bs = 16
    m = make_manager([full_spec(bs)], 11, max_num_batched_tokens=128)
    common = list(range(3 * bs))
    r0 = make_request("0", common + list(range(1000, 1007)), bs)
    hit, n, new = run_prefill(m, r0)
    assert n == 0 and new.get_block_ids() == ([1, 2, 3, 4],)
    r1 = make_request("1", common + list(range(2000, 2005)), bs)
    hit, n = m.get_computed_blocks(r1)
    assert n == 3 * bs and hit.get_block_ids() == ([1, 2, 3],)
    new = m.allocate_slots(r1, r1.num_tokens - n, n, hit)
    assert new.get_block_ids() == ([5],)
    assert [b.ref_cnt for b in hit.blocks[0]] == [2, 2, 2]
    assert m.get_block_ids("1") == ([1, 2, 3, 5],)
    m.free(r0)
    m.free(r1)
    assert free_ids(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]


def test_cache_salt_prevents_sharing():
    """Requests with different cache salts never hit each other's blocks."""
    m = make_manager([full_spec(4)], 20)
    a = make_request("a", range(12), 4, cache_salt="x")
    run_prefill(m, a)
    m.free(a)
    _, n = m.get_computed_blocks(make_request("b", range(12), 4, cache_salt="y"))
    assert n == 0
    _, n = m.get_computed_blocks(make_request("c", range(12), 4, cache_salt="x"))
    assert n == 8


def test_prefix_cache_stats_count_tokens():
    """Lookups record queried and hit tokens."""
    m = make_manager([full_spec(4)], 20)
    a = make_request("a", range(12), 4)
    run_prefill(m, a)
    m.get_computed_blocks(make_request("b", range(12), 4))
    st = m.prefix_cache_stats
    assert (st.requests, st.queries, st.hits) == (2, 24, 8)
    assert st.hit_rate == pytest.approx(8 / 24)


# -- allocate_slots ---------------------------------------------------------------------------


def test_allocate_slots_returns_only_new_blocks():
    """allocate_slots returns the newly allocated blocks, not the hits."""
    m = make_manager([full_spec(4)], 20)
    a = make_request("a", range(12), 4)
    run_prefill(m, a)
    b = make_request("b", list(range(12)) + [99, 98], 4)
    hit, n = m.get_computed_blocks(b)
    new = m.allocate_slots(b, b.num_tokens - n, n, hit)
    assert isinstance(new, KVCacheBlocks)
    assert len(new.blocks[0]) == 1
    assert m.get_blocks("b").blocks[0] == hit.blocks[0] + new.blocks[0]


def test_allocate_slots_none_when_it_cannot_fit_changes_nothing():
    """allocate_slots returns None when the blocks do not fit, leaving pool and hits untouched."""
    m = make_manager([full_spec(4)], 8)  # 7 usable blocks
    a = make_request("a", range(12), 4)
    run_prefill(m, a)
    m.free(a)  # 3 cached, evictable blocks
    hog = make_request("hog", range(500, 516), 4)
    run_prefill(m, hog)  # takes the 4 uncached blocks
    assert m.block_pool.get_num_free_blocks() == 3
    b = make_request("b", list(range(12)) + list(range(100, 120)), 4)
    hit, n = m.get_computed_blocks(b)
    assert n == 12
    before = (free_ids(m), [blk.ref_cnt for blk in m.block_pool.blocks])
    assert m.allocate_slots(b, b.num_tokens - n, n, hit) is None
    assert (free_ids(m), [blk.ref_cnt for blk in m.block_pool.blocks]) == before
    assert m.get_block_ids("b") == ([],)


def test_allocate_slots_counts_evictable_hits_against_free_blocks():
    """Evictable hits cost free blocks: a request that fits only by evicting its own hits is
    rejected."""
    m = make_manager([full_spec(4)], 6)  # 5 usable
    a = make_request("a", range(12), 4)
    run_prefill(m, a)
    m.free(a)
    b = make_request("b", list(range(12)) + list(range(100, 108)), 4)
    hit, n = m.get_computed_blocks(b)
    # Needs 5 blocks total: 3 hits (evictable) + 2 new = 5 free blocks -> fits exactly.
    assert m.allocate_slots(b, b.num_tokens - n, n, hit) is not None
    m.free(b)
    c = make_request("c", list(range(12)) + list(range(100, 112)), 4)
    hit, n = m.get_computed_blocks(c)
    assert m.allocate_slots(c, c.num_tokens - n, n, hit) is None


def test_allocate_slots_respects_reserved_blocks():
    """reserved_blocks are kept free."""
    m = make_manager([full_spec(4)], 6)  # 5 usable
    a = make_request("a", range(16), 4)
    assert m.allocate_slots(a, 16, reserved_blocks=2) is None
    assert m.allocate_slots(a, 12, reserved_blocks=2) is not None


def test_full_sequence_check_keeps_reserved_blocks_free():
    """The full-sequence admission check counts reserved blocks as taken too: a chunk that
    fits beside them is refused when the whole prompt would not."""
    m = make_manager([full_spec(4)], 6)  # 5 usable
    a = make_request("a", range(16), 4)  # 4 blocks in all
    assert m.allocate_slots(a, 8, full_sequence_must_fit=True, reserved_blocks=2) is None
    assert m.block_pool.get_num_free_blocks() == 5
    assert m.allocate_slots(a, 8, full_sequence_must_fit=True, reserved_blocks=1) is not None


def test_allocate_slots_needs_tokens():
    """Allocating zero new and zero external tokens is a ConfigError."""
    m = make_manager([full_spec(4)], 6)
    with pytest.raises(ConfigError, match="num_new_tokens"):
        m.allocate_slots(make_request("a", range(4), 4), 0)


def test_decode_allocates_block_on_boundary_and_caches_output():
    """Decoding allocates a block when a block fills up and caches generated full blocks."""
    m = make_manager([full_spec(4)], 20)
    a = make_request("a", range(7), 4, max_tokens=8)
    run_prefill(m, a)
    a.append_output_token_ids(70)  # 8 tokens
    assert m.allocate_slots(a, 1).blocks == ([],)
    a.num_computed_tokens = 8
    a.append_output_token_ids(71)  # 9 tokens
    new = m.allocate_slots(a, 1)
    assert len(new.blocks[0]) == 1
    a.num_computed_tokens = 9
    assert [b.block_hash is not None for b in m.get_blocks("a").blocks[0]] == [True, True, False]


def test_delay_cache_blocks_skips_caching():
    """With delay_cache_blocks nothing is cached until cache_blocks is called."""
    m = make_manager([full_spec(4)], 20)
    a = make_request("a", range(12), 4)
    m.allocate_slots(a, 0, num_external_computed_tokens=8, delay_cache_blocks=True)
    assert list(m.block_pool.iter_cached_blocks()) == []
    m.cache_blocks(a, 8)
    assert len(list(m.block_pool.iter_cached_blocks())) == 2


def test_lookahead_tokens_get_slots():
    """Lookahead tokens get slots beyond the new tokens."""
    m = make_manager([full_spec(4)], 20)
    a = make_request("a", range(4), 4)
    new = m.allocate_slots(a, 4, num_lookahead_tokens=3)
    assert len(new.blocks[0]) == 2


# -- free, events, usage -----------------------------------------------------------------------


def test_free_returns_all_blocks():
    """free() returns every block of the request to the pool."""
    m = make_manager([full_spec(4)], 20)
    a = make_request("a", range(10), 4)
    run_prefill(m, a)
    assert m.usage == pytest.approx(3 / 19)
    m.free(a)
    assert m.usage == 0.0
    assert m.block_pool.get_num_free_blocks() == 19
    assert m.get_block_ids("a") == ([],)


def test_block_pool_is_shared_object():
    """The manager exposes its coordinator's pool."""
    m = make_manager([full_spec(4)], 20)
    assert isinstance(m.block_pool, BlockPool)
    assert m.block_pool is m.coordinator.block_pool


def test_take_events_reports_stores_and_removals():
    """The manager's events show stored prompt blocks, then removals when they are reused."""
    m = make_manager([full_spec(4)], 4, enable_kv_cache_events=True)  # 3 usable
    a = make_request("a", range(8), 4)
    run_prefill(m, a)
    (ev,) = m.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [to_external_hash(h) for h in a.block_hashes]
    assert ev.kv_cache_spec_kind == "full_attention"
    m.free(a)
    run_prefill(m, make_request("b", range(100, 112), 4))
    evs = m.take_events()
    removed = [h for e in evs if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(to_external_hash(h) for h in a.block_hashes)
    assert m.take_events() == []


def test_reset_prefix_cache_through_manager():
    """reset_prefix_cache fails while a request holds blocks and succeeds after it is freed."""
    m = make_manager([full_spec(4)], 20, enable_kv_cache_events=True)
    a = make_request("a", range(8), 4)
    run_prefill(m, a)
    m.take_events()
    assert m.reset_prefix_cache() is False
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.take_events() == [AllBlocksCleared(medium="GPU")]
    _, n = m.get_computed_blocks(make_request("b", range(8), 4))
    assert n == 0


def test_evict_blocks_through_manager_shrinks_hit():
    """Evicting a cached block makes later lookups stop before it."""
    m = make_manager([full_spec(4)], 20)
    a = make_request("a", range(16), 4)
    run_prefill(m, a)
    m.free(a)
    m.evict_blocks([m.block_pool.get_cached_block(a.block_hashes[1], [0])[0].block_id])
    _, n = m.get_computed_blocks(make_request("b", range(16), 4))
    assert n == 4


def test_rollback_uncaches_blocks_past_valid_tokens():
    """rollback evicts the request's own cached blocks past num_valid_tokens and re-caches them
    later."""
    m = make_manager([full_spec(4)], 20)
    a = make_request("a", range(16), 4)
    run_prefill(m, a)
    m.rollback(a, 4)
    blocks = m.get_blocks("a").blocks[0]
    assert [b.block_hash is not None for b in blocks] == [True, False, False, False]
    m.cache_blocks(a, 16)
    assert [b.block_hash is not None for b in blocks] == [True, True, True, True]


def test_rollback_uncaches_a_partly_valid_block():
    """A block that holds some invalid tokens is the first invalid block: it leaves the
    prefix cache with everything after it."""
    m = make_manager([full_spec(4)], 20)
    a = make_request("a", range(16), 4)
    run_prefill(m, a)
    assert m.rollback(a, 6) == 6
    blocks = m.get_blocks("a").blocks[0]
    assert [b.block_hash is not None for b in blocks] == [True, False, False, False]


def test_rollback_keeps_blocks_another_request_shares_cached():
    """Only the request's own blocks leave the cache: a block another request also holds
    keeps its hash (its contents were computed by, and are good for, that request)."""
    m = make_manager([full_spec(4)], 20)
    a = make_request("a", range(16), 4)
    run_prefill(m, a)
    b = make_request("b", list(range(8)) + [99] * 8, 4)
    hit, n = m.get_computed_blocks(b)
    assert n == 8
    assert m.allocate_slots(b, b.num_tokens - n, n, hit) is not None
    m.rollback(a, 0)
    blocks = m.get_blocks("a").blocks[0]
    assert [blk.block_hash is not None for blk in blocks] == [True, True, False, False]
    _, n = m.get_computed_blocks(make_request("c", range(16), 4))
    assert n == 8


def _swa_request_with_skipped_blocks():
    """A sliding-window (window 4, blocks of 4) request that computed 12 of its 16 tokens
    and released blocks 0 and 1 (out of its window): its table is [null, null, b2, b3]."""
    m = make_manager([swa_spec(4, 4)], 20)
    req = make_request("r", range(16), 4)
    assert m.allocate_slots(req, 16) is not None
    req.num_computed_tokens = 12
    m.remove_skipped_blocks(req)
    table = m.get_blocks("r").blocks[0]
    assert [b.is_null for b in table] == [True, True, False, False]
    return m, req, table


def test_sliding_window_rollback_resumes_when_its_window_is_intact():
    """Rolling back to 12 tokens needs only block 2 (tokens 9-11): the nulls before the
    window do not force a restart."""
    m, req, table = _swa_request_with_skipped_blocks()
    kept = list(table)
    assert m.rollback(req, 12) == 12
    assert m.get_blocks("r").blocks[0] == kept


def test_sliding_window_rollback_restarts_when_its_window_was_skipped():
    """Rolling back to 8 tokens needs block 1 (tokens 5-7), which was released: the
    request restarts from scratch and holds no block."""
    m, req, _ = _swa_request_with_skipped_blocks()
    free_before = m.block_pool.get_num_free_blocks()
    assert m.rollback(req, 8) == 0
    assert m.get_blocks("r").blocks[0] == []
    assert m.block_pool.get_num_free_blocks() == free_before + 2


def test_rollback_to_zero_frees_cut_blocks_tail_first():
    """A table cut at its leading nulls frees its real blocks tail first, like ``free``."""
    m, req, table = _swa_request_with_skipped_blocks()
    b2, b3 = table[2], table[3]
    assert m.rollback(req, 0) == 0
    assert m.get_blocks("r").blocks[0] == []
    front = m.block_pool.free_block_queue.get_all_free_blocks()[:2]
    assert front == [b3, b2]


# -- admission with caps --------------------------------------------------------------------------


def test_long_sliding_window_request_admitted_and_runs_to_completion():
    """A sliding-window request longer than the whole pool is admitted and finishes by recycling
    blocks."""
    bs, sw, mnbt = 4, 8, 16
    # 9 usable
    m = make_manager([swa_spec(bs, sw)], 10, max_model_len=4096, max_num_batched_tokens=mnbt)
    cap = m.coordinator.single_type_managers[0].max_admission_blocks_per_request
    assert cap == cdiv(sw - 1 + mnbt, bs) + 1 == 7
    req = make_request("long", [i % 50 for i in range(200)], bs, max_tokens=8)
    assert cdiv(req.num_tokens + req.max_tokens, bs) > 9  # longer than the whole pool
    assert m.can_ever_fit(req)
    first = True
    while req.num_computed_tokens < req.num_tokens:
        chunk = min(mnbt, req.num_tokens - req.num_computed_tokens)
        new = m.allocate_slots(req, chunk, full_sequence_must_fit=first)
        assert new is not None, f"stalled at {req.num_computed_tokens} tokens"
        first = False
        req.num_computed_tokens += chunk
        real = [b for b in m.get_blocks("long").blocks[0] if not b.is_null]
        assert len(real) <= cap
    for tok in range(req.max_tokens):
        req.append_output_token_ids(1000 + tok)
        assert m.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        real = [b for b in m.get_blocks("long").blocks[0] if not b.is_null]
        assert len(real) <= cap
    assert req.num_computed_tokens == 208
    m.free(req)
    assert m.block_pool.get_num_free_blocks() == 9


def test_long_sliding_window_first_allocation_returns_blocks():
    """full_sequence_must_fit=True admits the long SWA request and returns its first blocks."""
    m = make_manager([swa_spec(4, 8)], 10, max_model_len=4096, max_num_batched_tokens=16)
    req = make_request("long", range(200), 4, max_tokens=8)
    new = m.allocate_slots(req, 16, full_sequence_must_fit=True)
    assert new is not None and len(new.blocks[0]) == 4


def test_full_attention_request_that_never_fits_is_rejected():
    """A full-attention request needing more blocks than the pool has is rejected up front."""
    m = make_manager([full_spec(4)], 10, max_model_len=4096, max_num_batched_tokens=16)
    req = make_request("long", range(200), 4, max_tokens=8)
    assert not m.can_ever_fit(req)
    assert m.allocate_slots(req, 16, full_sequence_must_fit=True) is None
    assert m.block_pool.get_num_free_blocks() == 9
    assert m.get_block_ids("long") == ([],)
    # Without the full-sequence gate the first chunk alone would fit.
    assert m.allocate_slots(req, 16) is not None


def test_can_ever_fit_true_for_small_full_attention_request():
    """A full-attention request within the pool can fit."""
    m = make_manager([full_spec(4)], 10, max_model_len=4096, max_num_batched_tokens=16)
    assert m.can_ever_fit(make_request("s", range(20), 4, max_tokens=8))


@pytest.mark.parametrize(("max_tokens", "fits"), [(16, True), (17, False)])
def test_can_ever_fit_counts_prompt_plus_max_tokens_against_usable_blocks(max_tokens, fits):
    """20 prompt tokens + 16 outputs fill exactly the 9 usable blocks of a 10-block pool
    (the null block is not usable); one more output token needs a tenth block."""
    m = make_manager([full_spec(4)], 10, max_model_len=4096, max_num_batched_tokens=16)
    assert m.can_ever_fit(make_request("r", range(20), 4, max_tokens=max_tokens)) is fits


def test_sliding_window_pool_smaller_than_cap_rejects():
    """A sliding-window request is rejected when the pool is smaller than its admission cap."""
    # cap 7 > 4
    m = make_manager([swa_spec(4, 8)], 5, max_model_len=4096, max_num_batched_tokens=16)
    req = make_request("long", range(200), 4, max_tokens=8)
    assert not m.can_ever_fit(req)
    assert m.allocate_slots(req, 16, full_sequence_must_fit=True) is None


# -- sliding window with external tokens ---------------------------------------------------------


def test_swa_local_hit_plus_external_tokens_on_tight_pool():
    """A local SWA hit followed by external tokens allocates (or returns None) instead of
    raising."""
    m = make_manager([swa_spec(2, 4)], 8, max_model_len=64, max_num_batched_tokens=16)  # 7 usable
    a = make_request("a", range(10), 2)
    m.allocate_slots(a, 10)
    m.free(a)  # 5 cached blocks, evictable
    filler = make_request("f", range(100, 140), 2)
    assert m.allocate_slots(filler, 6) is not None  # 3 blocks; one of a's cached blocks is evicted
    c = make_request("c", list(range(10)) + list(range(200, 210)), 2)
    hit, n = m.get_computed_blocks(c)
    assert n == 8
    result = m.allocate_slots(c, 2, n, hit, num_external_computed_tokens=4)
    assert result is not None
    # Blocks out of the window after the external tokens (first 9 tokens -> 4 blocks) are null.
    assert all(b.is_null for b in m.get_blocks("c").blocks[0][:4])


# -- KVCacheBlocks ----------------------------------------------------------------------------


def test_kv_cache_blocks_add_concatenates_each_group_in_order():
    """``a + b`` appends b's blocks after a's, group by group (vLLM's KVCacheBlocks)."""
    pool = BlockPool(8, True, 4)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    total = KVCacheBlocks(([b1], [b2])) + KVCacheBlocks(([b3], [b4]))
    assert total.get_block_ids() == ([b1.block_id, b3.block_id], [b2.block_id, b4.block_id])


def test_get_unhashed_block_ids_lists_only_uncached_blocks():
    """get_unhashed_block_ids names the blocks that hold no prefix-cache hash, in order;
    it needs a single group."""
    m = make_manager([full_spec(4)], 10)
    req = make_request("r", range(10), 4)  # 2 full blocks (cached) + 1 partial
    blocks = m.allocate_slots(req, 10)
    assert blocks is not None
    ids = blocks.get_block_ids()[0]
    assert blocks.get_unhashed_block_ids() == [ids[2]]
    with pytest.raises(ConfigError, match="one KV cache group, got 2"):
        KVCacheBlocks((blocks.blocks[0], [])).get_unhashed_block_ids()
