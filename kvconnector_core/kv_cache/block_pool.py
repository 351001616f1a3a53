"""The paged block pool: blocks, the LRU free queue, the prefix-hash map, events.

Eviction order is a contract (connectors and tests rely on it):

* a block whose ref count drops to 0 goes to the *front* of the free queue if
  it holds no hash (nothing worth keeping, reuse it first) and to the *back*
  if it is cached, so cached blocks are evicted least-recently-freed first;
* managers free a request's blocks in reverse order, so the tail of a prefix
  chain is evicted before its head;
* ``get_new_blocks`` pops from the front; a popped cached block loses its hash
  and a ``BlockRemoved`` event is emitted.

Block 0 is the *null block*: it fills skipped positions (e.g. blocks that
slid out of a sliding window), is never cached, never freed, and its ref count
is not maintained.

The blocks and the free queue live in ``_free_queue``, the prefix-hash map in
``_hash_map``; this module re-exports them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvconnector_core.errors import ConfigError, InvariantError, NoFreeBlocksError
from kvconnector_core.kv_cache._free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from kvconnector_core.kv_cache._hash_map import BlockHashToBlockMap
from kvconnector_core.kv_cache.hashing import (
    BlockHash,
    generate_block_extra_keys,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from kvconnector_core.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
    to_external_hash,
)

if TYPE_CHECKING:
    from kvconnector_core.request import Request

__all__ = [
    "BlockHashToBlockMap",
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "GPUBlockPoolView",
    "KVCacheBlock",
]


# Group-id suffixes of block hash keys (make_block_hash_with_group_id), precomputed.
_NUM_SUFFIXES = 256
_GROUP_SUFFIX = tuple(i.to_bytes(4, "big") for i in range(_NUM_SUFFIXES))


@runtime_checkable
class GPUBlockPoolView(Protocol):
    """The narrow surface of the GPU block pool that connectors may use.

    It is what ``bind_gpu_block_pool`` hands a connector. Pin a block with
    ``touch([block])`` (a block with a positive ref count is never evicted) and
    release the pin with ``free_blocks([block])``; find cached blocks by hash
    with ``get_cached_block`` or walk them with ``iter_cached_blocks``; watch the
    free-block count so pinning never starves allocation.
    """

    @property
    def num_gpu_blocks(self) -> int:
        """Total blocks in the pool, the null block included."""
        ...

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Increase each block's ref count (pin), taking free ones out of the free queue."""
        ...

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Decrease each block's ref count (unpin); blocks reaching 0 become evictable."""
        ...

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block for ``block_hash`` in each group, or None if any group misses."""
        ...

    def iter_cached_blocks(self) -> Iterator[KVCacheBlock]:
        """Every block currently in the prefix cache."""
        ...

    def get_num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free or evictable)."""
        ...


class BlockPool:
    """All KV blocks of one pool, with prefix caching and KV events.

    Args:
        num_blocks: total blocks, the null block 0 included (>= 2).
        enable_caching: keep full blocks in a prefix-hash map for reuse.
        hash_block_size: tokens per hashed block (the request's ``block_hashes`` unit).
        enable_kv_cache_events: record ``BlockStored`` / ``BlockRemoved`` /
            ``AllBlocksCleared`` for :meth:`take_events`.
        medium: medium named in the events ("GPU" for the engine's pool).

    Raises:
        ConfigError: fewer than 2 blocks or a non-positive hash block size.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        medium: str = MEDIUM_GPU,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ConfigError(
                f"num_blocks={num_blocks!r}; need an int >= 2 (block 0 is the null block)")
        if hash_block_size < 1:
            raise ConfigError(f"hash_block_size={hash_block_size}; must be >= 1")
        self.num_gpu_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.medium = medium
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Pinned for life: free_blocks skips it, so its ref count never returns to 0 and
        # touch can read "ref count 0" as "in the free queue" without an is_null test.
        self.null_block.ref_cnt = 1
        self.kv_event_queue: list[KVCacheEvent] = []

    # -- lookup ---------------------------------------------------------------

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """Return the cached block for ``block_hash`` in every group, or None on any miss."""
        # BlockHashToBlockMap.get_one_block and make_block_hash_with_group_id, inlined:
        # this runs once per prompt block on every admission.
        cache = self.cached_block_hash_to_block._cache
        cached: list[KVCacheBlock] = []
        for gid in kv_cache_group_ids:
            entry = cache.get(block_hash + (_GROUP_SUFFIX[gid] if gid < _NUM_SUFFIXES
                                            else gid.to_bytes(4, "big")))
            if entry is None:
                return None
            cached.append(entry if isinstance(entry, KVCacheBlock) else next(iter(entry.values())))
        return cached

    def iter_cached_blocks(self) -> Iterator[KVCacheBlock]:
        """Every block currently in the prefix cache."""
        return self.cached_block_hash_to_block.iter_blocks()

    # -- caching --------------------------------------------------------------

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        *,
        kv_cache_spec_kind: str | None = None,
        sliding_window: int | None = None,
    ) -> None:
        """Cache the request's full blocks ``[num_cached_blocks, num_full_blocks)``.

        Block ``i`` of the group gets the request's hash of block ``i`` (block
        sizes in units of ``block_size``; when ``block_size`` is a multiple of the
        hash block size the hash of the last hash block inside it is used, which
        by chaining identifies the whole prefix). Null blocks are skipped. One
        ``BlockStored`` event covers all newly cached blocks; a range with
        nothing to cache emits nothing.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        scale = block_size // self.hash_block_size
        hashes = request.block_hashes
        if len(hashes) < num_full_blocks * scale:
            raise InvariantError(
                f"request {request.request_id!r} has {len(hashes)} block hashes; "
                f"caching {num_full_blocks} blocks of {block_size} tokens needs "
                f"{num_full_blocks * scale}"
            )
        new_hashes: list[ExternalBlockHash] | None = [] if self.enable_kv_cache_events else None
        extra_keys: list[tuple[Any, ...] | None] = []
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            # A block that already holds a hash is skipped: it is the null block, or
            # a shared block re-reached after a request rolled back (failed KV load).
            if blk.is_null or blk.block_hash is not None:
                continue
            bh = hashes[(i + 1) * scale - 1]
            key = make_block_hash_with_group_id(bh, kv_cache_group_id)
            blk.block_hash = key
            self.cached_block_hash_to_block.insert(key, blk)
            if new_hashes is not None:
                new_hashes.append(to_external_hash(bh))
                extra_keys.append(
                    generate_block_extra_keys(i * scale, request.lora_name, request.cache_salt)
                )
        if new_hashes:
            parent_idx = num_cached_blocks * scale - 1
            parent = to_external_hash(hashes[parent_idx]) if parent_idx >= 0 else None
            tokens = request.all_token_ids[
                num_cached_blocks * block_size : num_full_blocks * block_size
            ]
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=new_hashes,
                    parent_block_hash=parent,
                    token_ids=list(tokens),
                    block_size=block_size,
                    lora_id=None,
                    medium=self.medium,
                    lora_name=request.lora_name,
                    extra_keys=extra_keys,  # one entry per block, as vLLM sends
                    group_idx=kv_cache_group_id,
                    kv_cache_spec_kind=kv_cache_spec_kind,
                    kv_cache_spec_sliding_window=sliding_window,
                )
            )

    # -- allocation -----------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue (ref count 1).

        Cached blocks taken this way are evicted from the prefix cache first.

        Raises:
            NoFreeBlocksError: fewer than ``num_blocks`` blocks are free.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise NoFreeBlocksError(num_blocks, self.free_block_queue.num_free_blocks)
        ret = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            cache = self.cached_block_hash_to_block._cache
            quiet = not self.enable_kv_cache_events
            for b in ret:
                key = b._block_hash
                if key is not None:
                    # Hot path inlined (the usual case: the only block under its hash,
                    # no events); duplicates and events take the full method.
                    if quiet and cache.get(key) is b:
                        del cache[key]
                        b._block_hash = None
                    else:
                        self._maybe_evict_cached_block(b)
                b.ref_cnt += 1
        else:
            for b in ret:
                b.ref_cnt += 1
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        key = block.block_hash
        if key is None:
            return False
        if self.cached_block_hash_to_block.pop(key, block.block_id) is None:
            return False
        block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockRemoved(
                    block_hashes=[to_external_hash(get_block_hash(key))],
                    medium=self.medium,
                    group_idx=get_group_id(key),
                )
            )
        return True

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Add a reference to each block (a cache hit or a pin).

        A block at ref count 0 leaves the free queue, so it cannot be evicted
        while referenced. The null block is skipped.
        """
        # Counts the blocks that stay out of the free queue (already referenced, or the
        # null block) instead of the revived ones: on a hit nearly every block is revived,
        # so the counter is almost never touched (this runs once per prompt block). The
        # null block is born pinned (ref count 1, see __init__) and never freed, so
        # "ref count 0" alone means "in the free queue": no is_null read per block.
        kept = 0
        try:
            for b in blocks:
                rc = b.ref_cnt  # read once
                if rc:
                    kept += 1
                else:
                    # FreeKVCacheBlockQueue.remove, inlined: one frame less per block. A block
                    # outside the queue has both links None, so the first write raises
                    # AttributeError before anything changes (zero-cost try in 3.11).
                    nxt = b.next_free_block
                    prev = b.prev_free_block
                    nxt.prev_free_block = prev  # type: ignore[union-attr]  # caught below
                    prev.next_free_block = nxt  # type: ignore[union-attr]  # caught below
                    b.prev_free_block = b.next_free_block = None
                b.ref_cnt = rc + 1
        except AttributeError:
            nxt, prev = b.next_free_block, b.prev_free_block
            if prev is not None and nxt is not None:
                raise  # not a broken link: something else is wrong
            if nxt is not None:
                nxt.prev_free_block = b  # undo the one write made before prev failed
            revived = list(blocks).index(b) - kept
            self.free_block_queue.num_free_blocks -= revived
            raise InvariantError(f"{b!r} has ref count 0 but is not in the free queue") from None
        self.free_block_queue.num_free_blocks -= len(blocks) - kept  # once, not per block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given (eviction) order.

        Blocks reaching 0 become free: unhashed ones at the front (reused
        first), hashed ones at the back (kept longest, LRU). The null block is
        skipped.

        Raises:
            InvariantError: a block's ref count would go negative.
        """
        uncached: list[KVCacheBlock] = []
        cached: list[KVCacheBlock] = []
        for b in ordered_blocks:
            if b.is_null:  # touched like any block, but never freed
                continue
            rc = b.ref_cnt
            if rc > 1:
                b.ref_cnt = rc - 1
            elif rc == 1:
                b.ref_cnt = 0
                (uncached if b._block_hash is None else cached).append(b)
            else:
                raise InvariantError(f"freeing {b!r} whose ref count is already {rc}")
        queue = self.free_block_queue
        if cached:
            queue.append_n(cached)  # one call for the run, not one per block
        if uncached:
            queue.prepend_n(uncached)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the given blocks from the prefix cache (their data is invalid).

        Only the hash is removed; a block still in use stays allocated.
        """
        for bid in block_ids:
            blk = self.blocks[bid]
            if not blk.is_null:
                self._maybe_evict_cached_block(blk)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; fails (returns False) while any block is in use."""
        num_used = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used != 1:  # only the null block may be "used"
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for b in self.blocks:
            b.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared(medium=self.medium))
        return True

    # -- accounting -----------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free, cached-but-unreferenced included)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (null block excluded) that are referenced."""
        total = self.num_gpu_blocks - 1
        return 1.0 - self.get_num_free_blocks() / total

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the events recorded since the last call."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
