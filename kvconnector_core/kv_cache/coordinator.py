"""Coordinates the single-type managers of all KV cache groups.

The coordinator is given the scheduler's block size explicitly and checks it:
every cache hit it reports and every block-aligned decision of the scheduler
uses that one number, so the coordinator never derives a different one of its
own (vLLM's hybrid coordinator used to recompute an LCM, which could disagree
with the scheduler).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvconnector_core.errors import BlockSizeError
from kvconnector_core.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvconnector_core.kv_cache.hashing import BlockHash
from kvconnector_core.kv_cache.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from kvconnector_core.kv_cache.single_type_manager import (
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)

if TYPE_CHECKING:
    from kvconnector_core.request import Request

__all__ = [
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "UnitaryKVCacheCoordinator",
    "check_block_sizes",
    "get_kv_cache_coordinator",
]

BlockLists = tuple[list[KVCacheBlock], ...]


def check_block_sizes(scheduler_block_size: int, hash_block_size: int,
                      group_block_sizes: Sequence[int]) -> None:
    """Validate the block-size relations the coordinator relies on.

    ``scheduler_block_size`` must be a positive multiple of ``hash_block_size``
    and of every group's block size, and every group's block size a multiple of
    ``hash_block_size`` (a group block's hash is the hash of its last hash block).

    Raises:
        BlockSizeError: a relation does not hold; the message gives the numbers.
    """
    sizes = tuple(group_block_sizes)

    def fail(msg: str) -> None:
        raise BlockSizeError(
            f"{msg} (scheduler_block_size={scheduler_block_size}, "
            f"hash_block_size={hash_block_size}, "
            f"group block sizes={list(sizes)})",
            scheduler_block_size, hash_block_size, sizes,
        )

    if scheduler_block_size < 1 or hash_block_size < 1:
        fail("block sizes must be >= 1")
    if scheduler_block_size % hash_block_size:
        fail(f"scheduler_block_size {scheduler_block_size} is not a multiple of "
             f"hash_block_size {hash_block_size}")
    for bs in sizes:
        if scheduler_block_size % bs:
            fail(f"scheduler_block_size {scheduler_block_size} is not a multiple of "
                 f"group block size {bs}")
        if bs % hash_block_size:
            fail(f"group block size {bs} is not a multiple of hash_block_size {hash_block_size}")


class KVCacheCoordinator:
    """Owns the block pool and one single-type manager per KV cache group.

    Args:
        kv_cache_config: pool size and groups.
        max_model_len: longest sequence a request may reach.
        max_num_batched_tokens: token budget of one scheduler step (for admission caps).
        scheduler_block_size: the scheduler's block size; cache hits are aligned to it.
        hash_block_size: tokens per hashed block.
        enable_caching: whether the pool keeps a prefix cache.
        enable_kv_cache_events: whether the pool records KV events.

    Raises:
        BlockSizeError: see :func:`check_block_sizes`.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        *,
        scheduler_block_size: int,
        hash_block_size: int,
        enable_caching: bool,
        enable_kv_cache_events: bool,
    ) -> None:
        check_block_sizes(
            scheduler_block_size,
            hash_block_size,
            [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups],
        )
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks, enable_caching, hash_block_size, enable_kv_cache_events
        )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                g.kv_cache_spec,
                max_num_batched_tokens,
                max_model_len,
                block_pool=self.block_pool,
                kv_cache_group_id=i,
                scheduler_block_size=scheduler_block_size,
            )
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: BlockLists,
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Sum of every group's block need (see ``SingleTypeKVCacheManager``)."""
        return sum(
            m.get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks[i], total_computed_tokens,
                apply_admission_cap
            )
            for i, m in enumerate(self.single_type_managers)
        )

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: BlockLists,
                                 total_computed_tokens: int = 0) -> None:
        """Add each group's local cache hits to the request's tables."""
        for m, blocks in zip(self.single_type_managers, new_computed_blocks):
            m.save_new_computed_blocks(request_id, blocks, total_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_computed_tokens: int) -> BlockLists:
        """Grow every group's table to ``num_tokens`` tokens; return the new blocks per group."""
        return tuple(
            m.allocate_new_blocks(request_id, num_tokens, num_computed_tokens)
            for m in self.single_type_managers
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full computed blocks in every group."""
        for m in self.single_type_managers:
            m.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        """Release the request's blocks in every group."""
        for m in self.single_type_managers:
            m.free(request_id)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks that left the request's attention window, in every group."""
        for m in self.single_type_managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_blocks(self, request_id: str) -> BlockLists:
        """The request's block table in every group."""
        return tuple(m.get_blocks(request_id) for m in self.single_type_managers)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
                               ) -> tuple[BlockLists, int]:
        """Longest usable cached prefix: ``(blocks per group, number of tokens)``."""
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: every lookup misses."""

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
                               ) -> tuple[BlockLists, int]:
        return tuple([] for _ in self.single_type_managers), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV cache group.

    The per-step methods call the single manager directly: they run once per
    running request per step, and iterating a one-element tuple through a
    generator costs more than the work itself on the decode path.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._manager = self.single_type_managers[0]

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: BlockLists,
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        return self._manager.get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks[0], total_computed_tokens,
            apply_admission_cap
        )

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_computed_tokens: int) -> BlockLists:
        return (self._manager.allocate_new_blocks(request_id, num_tokens, num_computed_tokens),)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self._manager.cache_blocks(request, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        self._manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
                               ) -> tuple[BlockLists, int]:
        m = self.single_type_managers[0]
        hits = type(m).find_longest_cache_hit(
            block_hashes, max_cache_hit_length, [0], self.block_pool, m.kv_cache_spec,
            self.scheduler_block_size
        )
        return hits, len(hits[0]) * m.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups (e.g. full attention + sliding window).

    Groups with equal specs are looked up together (a hit must be present in
    every member). The hit is a fixed point: start at the longest possible
    length and let each spec group shrink it until none does; full-attention
    groups are scanned once and afterwards only trimmed, since their hits are
    prefix-closed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        by_spec: dict[KVCacheSpec, list[int]] = {}
        for i, g in enumerate(self.kv_cache_config.kv_cache_groups):
            by_spec.setdefault(g.kv_cache_spec, []).append(i)
        # Full attention first: its one scan bounds everything else cheaply.
        self.spec_groups: list[tuple[KVCacheSpec, list[int]]] = sorted(
            by_spec.items(), key=lambda kv: not isinstance(kv[0], FullAttentionSpec)
        )

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
                               ) -> tuple[BlockLists, int]:
        align = self.scheduler_block_size
        hit_length = max_cache_hit_length - max_cache_hit_length % align
        results: dict[int, list[KVCacheBlock]] = {}
        scanned_full: set[int] = set()
        changed = True
        while changed:
            changed = False
            for spec, gids in self.spec_groups:
                bs = spec.block_size
                if isinstance(spec, FullAttentionSpec) and gids[0] in scanned_full:
                    for gid in gids:
                        del results[gid][hit_length // bs :]
                    continue
                mgr_cls = type(self.single_type_managers[gids[0]])
                hits = mgr_cls.find_longest_cache_hit(block_hashes, hit_length, gids,
                                                      self.block_pool, spec, align)
                for gid, lst in zip(gids, hits):
                    results[gid] = lst
                if isinstance(spec, FullAttentionSpec):
                    scanned_full.add(gids[0])
                new_length = len(hits[0]) * bs
                if new_length < hit_length:
                    hit_length = new_length
                    changed = True
            # One full-attention group plus others settles in a single pass
            # unless a later group shrank the hit; loop until stable.
        blocks = []
        for gid, g in enumerate(self.kv_cache_config.kv_cache_groups):
            lst = results[gid]
            del lst[hit_length // g.kv_cache_spec.block_size :]
            blocks.append(lst)
        return tuple(blocks), hit_length


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    max_num_batched_tokens: int,
    *,
    scheduler_block_size: int,
    hash_block_size: int,
    enable_caching: bool,
    enable_kv_cache_events: bool,
) -> KVCacheCoordinator:
    """Pick the coordinator for a config: no prefix cache, one group, or hybrid."""
    if not enable_caching:
        cls: type[KVCacheCoordinator] = KVCacheCoordinatorNoPrefixCache
    elif len(kv_cache_config.kv_cache_groups) == 1:
        cls = UnitaryKVCacheCoordinator
    else:
        cls = HybridKVCacheCoordinator
    return cls(kv_cache_config, max_model_len, max_num_batched_tokens,
               scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
               enable_caching=enable_caching, enable_kv_cache_events=enable_kv_cache_events)
