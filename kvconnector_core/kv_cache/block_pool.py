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
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvconnector_core.errors import ConfigError, InvariantError, NoFreeBlocksError
from kvconnector_core.kv_cache.hashing import (
    BlockHash,
    BlockHashWithGroupId,
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


class KVCacheBlock:
    """One physical KV block: id, ref count, cached hash and free-list links.

    The free-list links live on the block itself (an intrusive list) so the
    free queue can unlink any block in O(1) when a cache hit revives it.
    """

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: BlockHashWithGroupId | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        """The group-keyed hash if the block is cached, else None."""
        return self._block_hash

    @block_hash.setter
    def block_hash(self, block_hash: BlockHashWithGroupId) -> None:
        if self._block_hash is not None:
            raise InvariantError(f"block {self.block_id} already has a hash; reset it first")
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash (the block is being evicted or reused)."""
        self._block_hash = None

    def __repr__(self) -> str:
        h = self._block_hash.hex()[:8] if self._block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, front = next to evict.

    Not a ``deque``: a cache hit must pull a block out of the *middle* of the
    queue in O(1), which needs the intrusive links on :class:`KVCacheBlock`.
    Fake head and tail sentinels remove every empty-list branch: every block in
    the queue has both links set, so the hot paths below never test for None.
    """

    __slots__ = ("num_free_blocks", "_head", "_tail")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for b in blocks:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Remove and return the front block."""
        first = self._head.next_free_block
        if first is self._tail or first is None:
            raise NoFreeBlocksError(1, 0)
        self._unlink(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks, front first."""
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(n, self.num_free_blocks)
        # The sentinels make every link inside the queue non-None, which mypy cannot see:
        # the "sentinel-linked" ignores below stand for that invariant (no None test on
        # the hot path).
        out: list[KVCacheBlock] = []
        cur = self._head.next_free_block
        for _ in range(n):
            out.append(cur)  # type: ignore[arg-type]  # sentinel-linked
            nxt = cur.next_free_block  # type: ignore[union-attr]  # sentinel-linked
            cur.prev_free_block = cur.next_free_block = None  # type: ignore[union-attr]  # sentinel-linked
            cur = nxt
        self._head.next_free_block = cur
        cur.prev_free_block = self._head  # type: ignore[union-attr]  # sentinel-linked
        self.num_free_blocks -= n
        return out

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise InvariantError(f"{block!r} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue in O(1)."""
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the back (evicted last)."""
        last = self._tail.prev_free_block
        last.next_free_block = block  # type: ignore[union-attr]  # sentinel-linked
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Append ``blocks`` in order (linked in one pass, no call per block)."""
        self._link_run(self._tail.prev_free_block, blocks, self._tail)  # type: ignore[arg-type]  # sentinel-linked

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, keeping their order (blocks[0] evicted first)."""
        self._link_run(self._head, blocks, self._head.next_free_block)  # type: ignore[arg-type]  # sentinel-linked

    def _link_run(self, prev: KVCacheBlock, blocks: Sequence[KVCacheBlock],
                  nxt: KVCacheBlock) -> None:
        # Splice ``blocks`` between the adjacent nodes ``prev`` and ``nxt``.
        for b in blocks:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        cur = self._head.next_free_block
        while cur is not None and cur is not self._tail:
            yield cur
            cur = cur.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, front first (for tests and debugging)."""
        return list(self)


class BlockHashToBlockMap:
    """Map from group-keyed hash to the cached block(s) holding it.

    Several blocks may hold one hash (two requests missed the cache at the same
    time); all are kept so block tables stay append-only, and a lookup returns
    the first one cached.
    """

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        # Keyed by plain bytes: BlockPool's inlined lookups build keys by concatenation
        # (the public methods take BlockHashWithGroupId, which is bytes at run time).
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        """The first block cached under ``key``, or None."""
        entry = self._cache.get(key)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        """Record that ``block`` holds ``key``."""
        entry = self._cache.get(key)
        if entry is None:
            self._cache[key] = block
        elif isinstance(entry, KVCacheBlock):
            self._cache[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Forget that block ``block_id`` holds ``key``; return it, or None if it did not."""
        entry = self._cache.get(key)
        if entry is None:
            return None
        if isinstance(entry, KVCacheBlock):
            if entry.block_id != block_id:
                return None
            del self._cache[key]
            return entry
        block = entry.pop(block_id, None)
        if len(entry) == 1:
            self._cache[key] = next(iter(entry.values()))
        return block

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, key: object) -> bool:
        return key in self._cache

    def iter_blocks(self) -> Iterator[KVCacheBlock]:
        """Every cached block (duplicates included)."""
        for entry in self._cache.values():
            if isinstance(entry, KVCacheBlock):
                yield entry
            else:
                yield from entry.values()


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
            raise ConfigError(f"num_blocks={num_blocks!r}; need an int >= 2 (block 0 is the null block)")
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
                f"caching {num_full_blocks} blocks of {block_size} tokens needs {num_full_blocks * scale}"
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
            tokens = request.all_token_ids[num_cached_blocks * block_size : num_full_blocks * block_size]
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
        # so the counter is almost never touched (this runs once per prompt block).
        kept = 0
        for b in blocks:
            rc = b.ref_cnt  # read once
            if rc == 0 and not b.is_null:
                # FreeKVCacheBlockQueue.remove, inlined: one frame less per block.
                prev, nxt = b.prev_free_block, b.next_free_block
                if prev is None or nxt is None:
                    revived = list(blocks).index(b) - kept
                    self.free_block_queue.num_free_blocks -= revived
                    raise InvariantError(f"{b!r} has ref count 0 but is not in the free queue")
                prev.next_free_block = nxt
                nxt.prev_free_block = prev
                b.prev_free_block = b.next_free_block = None
            else:
                kept += 1
            b.ref_cnt = rc + 1
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
