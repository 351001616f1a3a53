"""The base of the per-attention-type managers: one group's block tables and allocation.

The attention-type managers (:mod:`~kvconnector_core.kv_cache.single_type_manager`)
override what differs per attention type: the cache-hit search, the skipped tokens and
the blocks to allocate.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from kvconnector_core.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvconnector_core.kv_cache.hashing import BlockHash
from kvconnector_core.kv_cache.kv_cache_spec import KVCacheSpec, cdiv

if TYPE_CHECKING:
    from kvconnector_core.request import Request


def _hash_at(block_hashes: Sequence[BlockHash], block_idx: int, scale: int) -> BlockHash:
    # Block i of size scale*hash_block_size ends where hash block (i+1)*scale-1 ends;
    # chaining makes that hash identify the whole prefix.
    return block_hashes[(block_idx + 1) * scale - 1]


class SingleTypeKVCacheManager:
    """Block tables and cache lookups of one KV cache group.

    Args:
        kv_cache_spec: the group's spec.
        block_pool: the pool shared by all groups.
        kv_cache_group_id: index of the group.
        scheduler_block_size: the scheduler's block size in tokens (cache hits
            are aligned to it).
        max_admission_blocks_per_request: cap applied by the full-sequence
            admission check (None: no cap, as for full attention).
    """

    spec_type: ClassVar[type[KVCacheSpec]] = KVCacheSpec

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        max_admission_blocks_per_request: int | None = None,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.scheduler_block_size = scheduler_block_size
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.hash_scale = self.block_size // block_pool.hash_block_size
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block

    # -- attention-type specific ------------------------------------------------

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose KV no computation will read again."""
        return 0

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Longest run of cached blocks usable as this request's prefix.

        Returns one block list per group id (equal lengths); the hit covers
        ``len(lists[0]) * block_size`` tokens, a multiple of ``alignment_tokens``,
        at most ``max_length``.
        """
        raise NotImplementedError

    # -- allocation ------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Free blocks needed to hold ``num_tokens`` tokens of the request.

        Counts new blocks plus cache hits that currently sit in the free queue
        (touching them takes them out of it). With ``apply_admission_cap`` the
        requirement is clamped to the spec's admission cap: the full-sequence
        check then asks "can this request ever run", not "can it hold every
        token at once".
        """
        num_required = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required = min(num_required, self.max_admission_blocks_per_request)
        held = len(self.req_to_blocks.get(request_id, ()))
        num_skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(num_required - max(num_skipped, held + len(new_computed_blocks)), 0)
        num_evictable = 0
        for blk in new_computed_blocks[num_skipped:]:
            if blk.ref_cnt == 0 and not blk.is_null:
                num_evictable += 1
        return num_new + num_evictable

    def save_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int = 0,
    ) -> None:
        """Add local cache hits to a new request's table, taking a reference on each.

        Hits that ``total_computed_tokens`` (local plus external tokens) already
        pushes out of the attention window are replaced by the null block and not
        referenced, matching what ``get_num_blocks_to_allocate`` counted.
        """
        if not new_computed_blocks:
            return
        num_skipped = min(self.get_num_skipped_tokens(total_computed_tokens) // self.block_size,
                          len(new_computed_blocks))
        blocks = list(new_computed_blocks)
        if num_skipped:
            blocks[:num_skipped] = [self._null_block] * num_skipped
        self.block_pool.touch(blocks[num_skipped:])
        self.req_to_blocks[request_id].extend(blocks)
        # Hits are cached already: caching resumes after them.
        self.num_cached_block[request_id] = len(self.req_to_blocks[request_id])

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Grow the request's table to cover ``num_tokens`` tokens; return the new blocks.

        Positions the request will never read (before its window) get the null
        block instead of a real one.
        """
        req_blocks = self.req_to_blocks[request_id]
        num_new = -(-num_tokens // self.block_size) - len(req_blocks)
        if num_new <= 0:  # the common decode step: the last block still has room
            return []
        self.num_cached_block.setdefault(request_id, len(req_blocks))
        num_skipped = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        num_null = max(0, min(num_skipped - len(req_blocks), num_new))
        if num_null:
            req_blocks.extend([self._null_block] * num_null)
        new_blocks = self.block_pool.get_new_blocks(num_new - num_null)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Put the request's full blocks among its first ``num_tokens`` tokens in the prefix
        cache."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        hashable_tokens = len(request.block_hashes) * self.block_pool.hash_block_size
        num_full = min(num_tokens, hashable_tokens) // self.block_size
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[rid],
            num_cached,
            num_full,
            self.block_size,
            self.kv_cache_group_id,
            kv_cache_spec_kind=self.kv_cache_spec.kind,
            sliding_window=getattr(self.kv_cache_spec, "sliding_window", None),
        )
        self.num_cached_block[rid] = num_full

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks, tail first (so tails are evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace blocks that fell out of the request's window with the null block and free them.

        Walks backwards from the last skipped position and stops at the first
        null block: everything before it was released earlier.
        """
        num_skipped = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        if num_skipped <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        removed: list[KVCacheBlock] = []
        null = self._null_block
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break
            removed.append(blocks[i])
            blocks[i] = null
        if removed:
            self.block_pool.free_blocks(removed)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table (empty if unknown)."""
        return self.req_to_blocks.get(request_id, [])
