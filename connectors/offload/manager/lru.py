"""The LRU cache policy of the CPU offloading tier (vLLM 0.33's ranks)."""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterator, Sequence

from connectors.offload.manager.policy import (
    CachePolicy,
    OffloadKey,
    RequestAccess,
    SlotEntry,
    Victims,
)

__all__ = ["LRUCachePolicy"]

Rank = tuple[int, int]


class LRUCachePolicy(CachePolicy):
    """Least-recently-used eviction by rank, as vLLM 0.33's LRU: the lowest rank goes first.

    A key's rank is ``(n, 0)`` when it is touched or its request finishes (``n`` from one
    counter, so later is higher), or ``(request rank, -position)`` while a request that
    stores or first sees it runs: a request gets its rank from the same counter on its
    first use, and its tail ranks below its head. A request that started earlier ranks
    below a later one even if it accesses later, until it finishes.

    Victims come from a min-heap of ``(rank, key)`` with lazy invalidation (a stale
    entry is skipped when popped); pinned and protected keys are put back.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._entries: dict[OffloadKey, SlotEntry] = {}
        self._ranks: dict[OffloadKey, Rank] = {}
        self._heap: list[tuple[Rank, OffloadKey]] = []
        self._next_rank = 0

    def get(self, key: OffloadKey) -> SlotEntry | None:
        """See :meth:`CachePolicy.get`."""
        return self._entries.get(key)

    def _request_rank(self, access: RequestAccess) -> int:
        if not access.rank:
            self._next_rank += 1
            access.rank = self._next_rank
        return access.rank

    def _push(self, updated: list[tuple[Rank, OffloadKey]]) -> None:
        # Rebuilding is linear: cheaper than one push per key for a long prefix.
        if len(updated) >= max(64, len(self._ranks) // 4):
            self._rebuild()
        else:
            for item in updated:
                heapq.heappush(self._heap, item)
            self._compact()

    def insert(self, key: OffloadKey, entry: SlotEntry, access: RequestAccess | None = None
               ) -> None:
        """See :meth:`CachePolicy.insert`; ranked with its request when given (the tail
        of the request below its head), else the most recent."""
        self._entries[key] = entry
        position = access.position.get(key) if access is not None else None
        if access is None or position is None:
            self._next_rank += 1
            rank = (self._next_rank, 0)
        else:
            rank = (self._request_rank(access), -position)
        self._ranks[key] = rank
        heapq.heappush(self._heap, (rank, key))  # compacted by the next evict()

    def remove(self, key: OffloadKey) -> None:
        """See :meth:`CachePolicy.remove`."""
        self._entries.pop(key, None)
        self._ranks.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """See :meth:`CachePolicy.touch`; each held key gets the next rank, tail first."""
        entries, ranks = self._entries, self._ranks
        rank = self._next_rank
        updated: list[tuple[Rank, OffloadKey]] = []
        for key in reversed(keys):
            if key in entries:
                rank += 1
                ranks[key] = (rank, 0)
                updated.append(((rank, 0), key))
        self._next_rank = rank
        self._push(updated)

    def on_access(self, keys: Sequence[OffloadKey], access: RequestAccess | None = None
                  ) -> None:
        """Ranked with the request at once (vLLM 0.33's ``on_request_access``), so keys a
        request just loaded are the last its own stores evict; without a request (or a
        position), a :meth:`touch`."""
        if access is None:
            self.touch(keys)
            return
        request_rank = self._request_rank(access)
        updated: list[tuple[Rank, OffloadKey]] = []
        ranks, position = self._ranks, access.position
        for key in keys:
            pos = position.get(key)
            if pos is None or key not in self._entries:
                continue
            rank = (request_rank, -pos)
            if ranks[key] < rank:
                ranks[key] = rank
                updated.append((rank, key))
        self._push(updated)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> Victims | None:
        """See :meth:`CachePolicy.evict`; the ``n`` lowest ranks that are evictable."""
        if n <= 0:
            return []
        self._compact()
        heap, ranks, entries = self._heap, self._ranks, self._entries
        picked: list[tuple[Rank, OffloadKey]] = []
        kept: list[tuple[Rank, OffloadKey]] = []
        while heap and len(picked) < n:
            item = heapq.heappop(heap)
            rank, key = item
            if ranks.get(key) != rank or (picked and item == picked[-1]):
                continue  # stale, or a duplicate of the same rank
            if entries[key].ref_cnt != 0 or key in protected:
                kept.append(item)
            else:
                picked.append(item)
        for item in kept:
            heapq.heappush(heap, item)
        if len(picked) < n:
            for item in picked:
                heapq.heappush(heap, item)
            return None
        victims: Victims = []
        for _, key in picked:
            del ranks[key]
            victims.append((key, entries.pop(key)))
        return victims

    def _compact(self) -> None:
        # Stale heap entries accumulate on every re-rank: rebuild when they dominate.
        if len(self._heap) > 2 * len(self._ranks) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(rank, key) for key, rank in self._ranks.items()]
        heapq.heapify(self._heap)

    def clear(self) -> None:
        """See :meth:`CachePolicy.clear`."""
        self._entries.clear()
        self._ranks.clear()
        self._heap.clear()
        self._next_rank = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[tuple[OffloadKey, SlotEntry]]:
        order = sorted(self._ranks.items(), key=lambda item: (item[1], item[0]))
        return iter([(key, self._entries[key]) for key, _ in order])
