"""KV blocks and the LRU free queue of the block pool (imported from ``block_pool``).

The eviction-order contract the queue implements is in ``block_pool``'s module docstring.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvconnector_core.errors import InvariantError, NoFreeBlocksError
from kvconnector_core.kv_cache.hashing import BlockHashWithGroupId

__all__ = ["FreeKVCacheBlockQueue", "KVCacheBlock"]


class KVCacheBlock:
    """One physical KV block: id, ref count, cached hash and free-list links.

    The free-list links live on the block itself (an intrusive list) so the
    free queue can unlink any block in O(1) when a cache hit revives it.
    """

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "prev_free_block", "next_free_block",
                 "is_null")

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
