"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).

A small FIFO ``S`` (10% of the capacity) takes new keys; a key evicted from ``S`` that was
used again moves to the main FIFO ``M``, others leave a ghost in ``G``; a stored key that
is a ghost enters ``M`` directly. ``M`` is a FIFO with reinsertion: a key used since it
was last examined goes back to its head with one use less. Uses count up to 3.

Adapted to the offload tier: pinned, in-flight and protected entries are skipped (they
stay where they are), and ``evict`` first checks that ``n`` victims exist, so a refusal
changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence

from connectors.offload.manager import CachePolicy, OffloadKey, RequestAccess, SlotEntry

__all__ = ["S3FIFOCachePolicy"]

_MAX_FREQ = 3


class S3FIFOCachePolicy(CachePolicy):
    """S3-FIFO over the offload tier's slots.

    Args:
        capacity: the tier's slots (bounds the ghost FIFO too).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._small: OrderedDict[OffloadKey, SlotEntry] = OrderedDict()
        self._main: OrderedDict[OffloadKey, SlotEntry] = OrderedDict()
        self._ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self._freq: dict[OffloadKey, int] = {}
        self._small_target = max(1, capacity // 10)

    def get(self, key: OffloadKey) -> SlotEntry | None:
        """See :meth:`CachePolicy.get`."""
        entry = self._small.get(key)
        return entry if entry is not None else self._main.get(key)

    def insert(self, key: OffloadKey, entry: SlotEntry, access: RequestAccess | None = None
               ) -> None:
        """See :meth:`CachePolicy.insert`; a ghost goes to M, a new key to S."""
        if self._ghost.pop(key, 0) is None:
            self._main[key] = entry
        else:
            self._small[key] = entry
        self._freq[key] = 0

    def remove(self, key: OffloadKey) -> None:
        """See :meth:`CachePolicy.remove`."""
        if self._small.pop(key, None) is None:
            self._main.pop(key, None)
        self._freq.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """See :meth:`CachePolicy.touch`; one more use of each held key (at most 3)."""
        freq = self._freq
        for key in keys:
            if key in freq:
                freq[key] = min(freq[key] + 1, _MAX_FREQ)

    def on_request_finished(self, keys: Sequence[OffloadKey], reused: Collection[OffloadKey],
                            stored: Collection[OffloadKey] | None = None) -> None:
        """Only reuses count as uses (a store is a key's first use, not its second)."""
        self.touch([k for k in keys if k in reused])

    def evict(self, n: int, protected: Collection[OffloadKey]
              ) -> list[tuple[OffloadKey, SlotEntry]] | None:
        """See :meth:`CachePolicy.evict`."""
        if n <= 0:
            return []
        if not self._can_evict(n, protected):
            return None
        victims: list[tuple[OffloadKey, SlotEntry]] = []
        while len(victims) < n:
            victim = (self._evict_small(protected) if len(self._small) > self._small_target
                      else None) or self._evict_main(protected) or self._evict_small(protected)
            if victim is not None:
                victims.append(victim)
        return victims

    def _can_evict(self, n: int, protected: Collection[OffloadKey]) -> bool:
        # Stops at the n-th evictable entry: a refusal must change nothing.
        found = 0
        for queue in (self._small, self._main):
            for key, entry in queue.items():
                if entry.ref_cnt == 0 and key not in protected:
                    found += 1
                    if found >= n:
                        return True
        return False

    def _next_small(self, protected: Collection[OffloadKey]) -> OffloadKey | None:
        return next((k for k, e in self._small.items() if e.ref_cnt == 0 and k not in protected),
                    None)

    def _evict_small(self, protected: Collection[OffloadKey]
                     ) -> tuple[OffloadKey, SlotEntry] | None:
        # From S's oldest evictable key on: used keys move to M, the first unused one leaves.
        while (key := self._next_small(protected)) is not None:
            entry = self._small.pop(key)
            if self._freq[key] > 1:
                self._main[key] = entry
                self._freq[key] = 0
                continue
            del self._freq[key]
            self._ghost[key] = None
            if len(self._ghost) > self.capacity:
                self._ghost.popitem(last=False)
            return key, entry
        return None

    def _evict_main(self, protected: Collection[OffloadKey]
                    ) -> tuple[OffloadKey, SlotEntry] | None:
        # FIFO with reinsertion: a used key goes back with one use less.
        for _ in range(len(self._main) * (_MAX_FREQ + 1)):
            if not self._main:
                return None
            key, entry = next(iter(self._main.items()))
            if entry.ref_cnt != 0 or key in protected or self._freq[key] > 0:
                if self._freq[key] > 0:
                    self._freq[key] -= 1
                self._main.move_to_end(key)
                continue
            del self._main[key], self._freq[key]
            return key, entry
        return None

    def clear(self) -> None:
        """See :meth:`CachePolicy.clear`."""
        for d in (self._small, self._main, self._ghost, self._freq):
            d.clear()

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __iter__(self) -> Iterator[tuple[OffloadKey, SlotEntry]]:
        return iter([*self._small.items(), *self._main.items()])
