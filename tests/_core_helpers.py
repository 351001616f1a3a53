"""Shared builders for the KV cache core unit tests (not a conftest: plain imports)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from kvconnector_core.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvconnector_core.kv_cache.hashing import get_block_hash, hash_request_tokens
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheManager
from kvconnector_core.kv_cache.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from kvconnector_core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, to_external_hash
from kvconnector_core.request import Request

__all__ = [
    "FakeRequest",
    "cache_at_positions",
    "cached_external_hashes",
    "chunked_spec",
    "full_spec",
    "make_manager",
    "make_request",
    "replay_events",
    "swa_spec",
]


def full_spec(block_size: int) -> FullAttentionSpec:
    """A small full-attention spec."""
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16")


def swa_spec(block_size: int, sliding_window: int) -> SlidingWindowSpec:
    """A small sliding-window spec."""
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=8,
        dtype="float16",
        sliding_window=sliding_window,
    )


def chunked_spec(block_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    """A small chunked-local-attention spec."""
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=8,
        dtype="float16",
        attention_chunk_size=chunk,
    )


def make_manager(
    specs: Sequence[KVCacheSpec],
    num_blocks: int,
    *,
    scheduler_block_size: int | None = None,
    hash_block_size: int | None = None,
    max_model_len: int = 1024,
    max_num_batched_tokens: int = 64,
    enable_caching: bool = True,
    enable_kv_cache_events: bool = False,
    reserve_full_output: bool = False,
) -> KVCacheManager:
    """A KVCacheManager with one group per spec (block sizes default to the first spec's)."""
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    bs = specs[0].block_size
    return KVCacheManager(
        KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups),
        max_model_len,
        max_num_batched_tokens,
        scheduler_block_size=scheduler_block_size or bs,
        hash_block_size=hash_block_size or bs,
        enable_caching=enable_caching,
        enable_kv_cache_events=enable_kv_cache_events,
        reserve_full_output=reserve_full_output,
    )


def make_request(
    request_id: str,
    token_ids: Sequence[int],
    hash_block_size: int,
    *,
    max_tokens: int = 4,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> Request:
    """A Request whose block hashes use ``hash_block_size``."""
    return Request(
        request_id,
        list(token_ids),
        max_tokens,
        hash_block_size=hash_block_size,
        cache_salt=cache_salt,
        lora_name=lora_name,
    )


class FakeRequest:
    """The few request attributes BlockPool.cache_full_blocks reads."""

    def __init__(
        self,
        request_id: str,
        token_ids: Sequence[int],
        hash_block_size: int,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids = list(token_ids)
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.block_hashes = hash_request_tokens(
            self.all_token_ids, hash_block_size, lora_name=lora_name, cache_salt=cache_salt
        )


def cache_at_positions(
    pool: BlockPool,
    request: FakeRequest,
    positions: Iterable[int],
    block_size: int,
    group_id: int = 0,
) -> dict[int, KVCacheBlock]:
    """Cache fresh blocks holding the request's blocks at ``positions`` (others stay uncached).

    The blocks are freed again, so they are cached but evictable. Returns position -> block.
    """
    positions = sorted(positions)
    if not positions:
        return {}
    blocks = pool.get_new_blocks(len(positions))
    table: list[KVCacheBlock] = [pool.null_block] * (positions[-1] + 1)
    for pos, blk in zip(positions, blocks):
        table[pos] = blk
    pool.cache_full_blocks(request, table, 0, positions[-1] + 1, block_size, group_id)
    pool.free_blocks(reversed(blocks))
    return dict(zip(positions, blocks))


def replay_events(events: Iterable[object], state: Counter | None = None) -> Counter:
    """Apply a KV event stream to a multiset of (group, external hash)."""
    state = Counter() if state is None else state
    for ev in events:
        if isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                state[(ev.group_idx, h)] += 1
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                state[(ev.group_idx, h)] -= 1
                if state[(ev.group_idx, h)] == 0:
                    del state[(ev.group_idx, h)]
                elif state[(ev.group_idx, h)] < 0:
                    raise AssertionError(f"BlockRemoved for {h} that was never stored")
        elif isinstance(ev, AllBlocksCleared):
            state.clear()
        else:
            raise AssertionError(f"unexpected event {ev!r}")
    return state


def cached_external_hashes(pool: BlockPool) -> Counter:
    """Multiset of (group, external hash) of every block in the pool's prefix cache."""
    out: Counter = Counter()
    for blk in pool.iter_cached_blocks():
        key = blk.block_hash
        assert key is not None
        out[(int.from_bytes(key[-4:], "big"), to_external_hash(get_block_hash(key)))] += 1
    return out
