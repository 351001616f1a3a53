"""Per-attention-type block bookkeeping for one KV cache group.

A :class:`SingleTypeKVCacheManager` owns the block tables of one group
(``req_to_blocks``) and knows three things about its attention type: how to
find the longest cached prefix, which leading tokens a request no longer needs
(``get_num_skipped_tokens``), and how many blocks a request may hold at once
(the admission cap). Skipped positions hold the pool's null block, so block
tables keep their token-to-block mapping.

The base class lives in ``_manager_base`` (re-exported here); this module holds the
attention types and :func:`get_manager_for_kv_cache_spec`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache._manager_base import SingleTypeKVCacheManager, _hash_at
from kvconnector_core.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvconnector_core.kv_cache.hashing import BlockHash
from kvconnector_core.kv_cache.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
)

__all__ = [
    "ChunkedLocalAttentionManager",
    "FullAttentionManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "get_manager_for_kv_cache_spec",
]


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block stays; hits are a left-to-right chained scan."""

    spec_type = FullAttentionSpec

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
        # Same result as the base method with nothing ever skipped, without the
        # skipped-token arithmetic and the slice copy (hot: once per decode step).
        num_required = -(-num_tokens // self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required = min(num_required, self.max_admission_blocks_per_request)
        blocks = self.req_to_blocks.get(request_id)
        held = len(blocks) if blocks is not None else 0
        num_new = num_required - held - len(new_computed_blocks)
        if num_new < 0:
            num_new = 0
        for blk in new_computed_blocks:
            if blk.ref_cnt == 0 and not blk.is_null:
                num_new += 1
        return num_new

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Nothing to do: full attention reads every block again."""

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, alignment_tokens: int
                               ) -> tuple[list[KVCacheBlock], ...]:
        bs = kv_cache_spec.block_size
        scale = bs // block_pool.hash_block_size
        hits: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        max_blocks = min(max_length // bs, len(block_hashes) // scale)
        get = block_pool.get_cached_block
        for i in range(max_blocks):
            cached = get(_hash_at(block_hashes, i, scale), kv_cache_group_ids)
            if cached is None:
                break
            for lst, blk in zip(hits, cached):
                lst.append(blk)
        align_blocks = max(1, alignment_tokens // bs)
        keep = len(hits[0]) - len(hits[0]) % align_blocks
        if keep != len(hits[0]):
            for lst in hits:
                del lst[keep:]
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window: only the last ``sliding_window`` tokens are needed.

    The cache hit is found right to left: the first run of
    ``cdiv(sliding_window - 1, block_size)`` consecutive cached blocks (from the
    end) is enough; blocks left of it are null.
    """

    spec_type = SlidingWindowSpec
    kv_cache_spec: SlidingWindowSpec  # narrowed: get_manager_for_kv_cache_spec picks by spec_type

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before ``num_computed_tokens - sliding_window + 1``."""
        return max(0, num_computed_tokens - self.kv_cache_spec.sliding_window + 1)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, alignment_tokens: int
                               ) -> tuple[list[KVCacheBlock], ...]:
        bs = kv_cache_spec.block_size
        scale = bs // block_pool.hash_block_size
        null = block_pool.null_block
        max_blocks = min(max_length // bs, len(block_hashes) // scale)
        # The coordinator passes this class's own spec type (spec_type).
        need = cdiv(cast(SlidingWindowSpec, kv_cache_spec).sliding_window - 1, bs)
        align_blocks = max(1, alignment_tokens // bs)
        hits = tuple([null] * max_blocks for _ in kv_cache_group_ids)
        get = block_pool.get_cached_block
        # With a window of one token nothing before the last token is read.
        length: int | None = max_blocks - max_blocks % align_blocks if need == 0 else None
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            if length is not None:
                break
            # A hit must end on an aligned boundary, so a run may only *start*
            # (from the right) at a block whose end is aligned; trimming a run
            # afterwards could leave a null block inside the window.
            if run == 0 and ((i + 1) * bs) % alignment_tokens:
                continue
            cached = get(_hash_at(block_hashes, i, scale), kv_cache_group_ids)
            if cached is None:
                run = 0
                continue
            for lst, blk in zip(hits, cached):
                lst[i] = blk
            run += 1
            if run >= need:
                length = i + need
        if length is None:
            # No full window anywhere: only a run starting at position 0 is
            # usable (nothing before it is needed); trimming it stays safe.
            length = 0
            while length < max_blocks:
                cached = get(_hash_at(block_hashes, length, scale), kv_cache_group_ids)
                if cached is None:
                    break
                for lst, blk in zip(hits, cached):
                    lst[length] = blk
                length += 1
            length -= length % align_blocks
        for lst in hits:
            del lst[length:]
        return hits


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention: tokens only see their own chunk.

    Blocks before the chunk containing ``max_length`` count as (null) hits.
    """

    spec_type = ChunkedLocalAttentionSpec
    # narrowed: get_manager_for_kv_cache_spec picks by spec_type
    kv_cache_spec: ChunkedLocalAttentionSpec

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the start of the chunk that ``num_computed_tokens`` is in."""
        chunk = self.kv_cache_spec.attention_chunk_size
        return (num_computed_tokens // chunk) * chunk

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, alignment_tokens: int
                               ) -> tuple[list[KVCacheBlock], ...]:
        bs = kv_cache_spec.block_size
        scale = bs // block_pool.hash_block_size
        null = block_pool.null_block
        # cast: kv_cache_spec is this class's spec_type
        chunk = cast(ChunkedLocalAttentionSpec, kv_cache_spec).attention_chunk_size
        max_blocks = min(max_length // bs, len(block_hashes) // scale)
        local_start = (max_length // chunk) * chunk
        num_null = min(local_start // bs, max_blocks)
        hits = tuple([null] * num_null for _ in kv_cache_group_ids)
        get = block_pool.get_cached_block
        for i in range(num_null, max_blocks):
            cached = get(_hash_at(block_hashes, i, scale), kv_cache_group_ids)
            if cached is None:
                break
            for lst, blk in zip(hits, cached):
                lst.append(blk)
        align_blocks = max(1, alignment_tokens // bs)
        keep = len(hits[0]) - len(hits[0]) % align_blocks
        for lst in hits:
            del lst[keep:]
        return hits


_MANAGERS: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
}


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec,
    max_num_batched_tokens: int,
    max_model_len: int,
    *,
    block_pool: BlockPool,
    kv_cache_group_id: int,
    scheduler_block_size: int,
) -> SingleTypeKVCacheManager:
    """Build the manager for a spec, with the admission cap for specs that recycle blocks.

    Raises:
        ConfigError: the spec type has no manager.
    """
    manager_cls = _MANAGERS.get(type(kv_cache_spec))
    if manager_cls is None:
        raise ConfigError(
            f"no KV cache manager for spec {type(kv_cache_spec).__name__}; known specs: "
            f"{', '.join(t.__name__ for t in _MANAGERS)}"
        )
    cap = None
    if not isinstance(kv_cache_spec, FullAttentionSpec):
        cap = kv_cache_spec.max_admission_blocks_per_request(max_num_batched_tokens, max_model_len)
    return manager_cls(kv_cache_spec, block_pool, kv_cache_group_id, scheduler_block_size, cap)
