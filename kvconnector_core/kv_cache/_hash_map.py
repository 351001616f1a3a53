"""The block pool's prefix-hash map: block hash -> cached blocks (imported from ``block_pool``)."""

from __future__ import annotations

from collections.abc import Iterator

from kvconnector_core.kv_cache._free_queue import KVCacheBlock
from kvconnector_core.kv_cache.hashing import BlockHashWithGroupId

__all__ = ["BlockHashToBlockMap"]


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
