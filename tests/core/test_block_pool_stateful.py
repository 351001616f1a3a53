"""Stateful property test of BlockPool: ref counts, the free queue, the prefix map and events
agree."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvconnector_core.errors import NoFreeBlocksError
from kvconnector_core.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvconnector_core.kv_cache.hashing import get_block_hash

from _core_helpers import FakeRequest, cached_external_hashes, replay_events

BS = 2
NUM_BLOCKS = 9


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives a BlockPool with allocations, frees, cache hits, caching, eviction and resets."""

    @initialize()
    def setup(self) -> None:
        self.pool = BlockPool(NUM_BLOCKS, True, BS, enable_kv_cache_events=True)
        # Model: every reference we hold, one list entry per ref.
        self.held: list[KVCacheBlock] = []
        self.replayed: Counter = Counter()
        self.fresh = itertools.count()

    # -- rules ---------------------------------------------------------------------

    @rule(n=st.integers(min_value=0, max_value=NUM_BLOCKS))
    def allocate(self, n: int) -> None:
        """Allocate n blocks, or check that an oversize request changes nothing."""
        free_before = self.pool.get_num_free_blocks()
        if n > free_before:
            with pytest.raises(NoFreeBlocksError):
                self.pool.get_new_blocks(n)
            assert self.pool.get_num_free_blocks() == free_before
            return
        got = self.pool.get_new_blocks(n)
        assert len(got) == n
        for b in got:
            assert b.ref_cnt == 1 and b.block_hash is None and not b.is_null
        self.held.extend(got)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        """Free a random subset of held references in a random order."""
        idx = data.draw(
            st.lists(st.integers(0, len(self.held) - 1), unique=True, max_size=len(self.held))
        )
        order = data.draw(st.permutations(idx))
        to_free = [self.held[i] for i in order]
        for i in sorted(idx, reverse=True):
            del self.held[i]
        queue_before = [b.block_id for b in self.pool.free_block_queue]
        # A block is released when its *last* reference in this call is dropped.
        refs = {b.block_id: b.ref_cnt for b in to_free}
        released = []
        for b in to_free:
            refs[b.block_id] -= 1
            if refs[b.block_id] == 0:
                released.append(b.block_id)
        self.pool.free_blocks(to_free)
        unhashed = [bid for bid in released if self.pool.blocks[bid].block_hash is None]
        hashed = [bid for bid in released if self.pool.blocks[bid].block_hash is not None]
        # Unhashed go to the front (in free order), hashed to the back (in free order).
        assert [b.block_id for b in self.pool.free_block_queue] == unhashed + queue_before + hashed

    @precondition(lambda self: any(True for _ in self.pool.iter_cached_blocks()))
    @rule(data=st.data())
    def touch_cached(self, data: st.DataObject) -> None:
        """Cache-hit a cached block by hash and take a reference on it."""
        cached = sorted(self.pool.iter_cached_blocks(), key=lambda b: b.block_id)
        blk = data.draw(st.sampled_from(cached))
        key = blk.block_hash
        found = self.pool.get_cached_block(get_block_hash(key), [int.from_bytes(key[-4:], "big")])
        assert found is not None
        hit = found[0]
        assert hit.block_hash == key
        self.pool.touch([hit])
        assert hit not in list(self.pool.free_block_queue)
        self.held.append(hit)

    @precondition(lambda self: any(b.block_hash is None for b in self.held))
    @rule(data=st.data(), group=st.integers(0, 1))
    def cache_fresh(self, data: st.DataObject, group: int) -> None:
        """Cache a held, uncached block under a never-seen hash."""
        blk = data.draw(
            st.sampled_from(
                sorted({b for b in self.held if b.block_hash is None}, key=lambda b: b.block_id)
            )
        )
        n = next(self.fresh)
        req = FakeRequest(f"r{n}", [n, -n], BS)
        self.pool.cache_full_blocks(req, [blk], 0, 1, BS, group)
        assert blk.block_hash is not None
        assert self.pool.get_cached_block(req.block_hashes[0], [group])[0] is blk

    @precondition(
        lambda self: (
            any(b.block_hash is None for b in self.held)
            and any(True for _ in self.pool.iter_cached_blocks())
        )
    )
    @rule(data=st.data())
    def cache_duplicate(self, data: st.DataObject) -> None:
        """Cache a held, uncached block under a hash another block already holds."""
        blk = data.draw(
            st.sampled_from(
                sorted({b for b in self.held if b.block_hash is None}, key=lambda b: b.block_id)
            )
        )
        other = data.draw(
            st.sampled_from(sorted(self.pool.iter_cached_blocks(), key=lambda b: b.block_id))
        )
        key = other.block_hash

        class _Req:
            request_id = "dup"
            all_token_ids = [0] * BS
            lora_name = None
            cache_salt = None
            block_hashes = [get_block_hash(key)]

        group = int.from_bytes(key[-4:], "big")
        self.pool.cache_full_blocks(_Req(), [blk], 0, 1, BS, group)
        assert blk.block_hash == key
        # The first block cached under a hash stays the one lookups return.
        assert self.pool.get_cached_block(get_block_hash(key), [group])[0] is not blk

    @rule(ids=st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=4))
    def evict(self, ids: list[int]) -> None:
        """Evict some block ids from the prefix cache; their ref counts do not change."""
        refs = [b.ref_cnt for b in self.pool.blocks]
        self.pool.evict_blocks(ids)
        for bid in ids:
            assert self.pool.blocks[bid].block_hash is None
        assert [b.ref_cnt for b in self.pool.blocks] == refs

    @rule()
    def reset(self) -> None:
        """reset_prefix_cache succeeds iff no block is held."""
        ok = self.pool.reset_prefix_cache()
        assert ok == (not self.held)
        if ok:
            assert not any(True for _ in self.pool.iter_cached_blocks())

    @rule()
    def drain_events(self) -> None:
        """Consume the pending events into the replayed state."""
        replay_events(self.pool.take_events(), self.replayed)

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def block_accounting(self) -> None:
        """free + used + null == total, and the queue holds exactly the ref-0 blocks."""
        pool = self.pool
        used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert pool.get_num_free_blocks() + used + 1 == NUM_BLOCKS
        queue = list(pool.free_block_queue)
        assert len(queue) == pool.get_num_free_blocks()
        assert {b.block_id for b in queue} == {
            b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0
        }
        assert pool.null_block not in queue

    @invariant()
    def ref_counts_match_model(self) -> None:
        """Every ref count is non-negative and equals the references the model holds."""
        counts = Counter(b.block_id for b in self.held)
        for b in self.pool.blocks[1:]:
            assert b.ref_cnt >= 0
            assert b.ref_cnt == counts.get(b.block_id, 0)

    @invariant()
    def prefix_map_iff_hashed(self) -> None:
        """A block is in the prefix map iff it carries a hash (the null block never does)."""
        in_map = {b.block_id for b in self.pool.iter_cached_blocks()}
        hashed = {b.block_id for b in self.pool.blocks if b.block_hash is not None}
        assert in_map == hashed
        assert 0 not in hashed
        assert len(list(self.pool.iter_cached_blocks())) == len(in_map)

    @invariant()
    def events_replay_to_cached_set(self) -> None:
        """Replaying every event emitted so far gives exactly the cached hashes."""
        replay_events(self.pool.take_events(), self.replayed)
        assert self.replayed == cached_external_hashes(self.pool)


BlockPoolMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
TestBlockPoolStateful = BlockPoolMachine.TestCase
