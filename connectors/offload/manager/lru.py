"""The LRU cache policy of the CPU offloading tier."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence

from connectors.offload.manager.policy import CachePolicy, OffloadKey, SlotEntry, Victims

__all__ = ["LRUCachePolicy"]


class LRUCachePolicy(CachePolicy):
    """Least-recently-used eviction; the front of the ordered dict is evicted first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._entries: OrderedDict[OffloadKey, SlotEntry] = OrderedDict()

    def get(self, key: OffloadKey) -> SlotEntry | None:
        """See :meth:`CachePolicy.get`."""
        return self._entries.get(key)

    def insert(self, key: OffloadKey, entry: SlotEntry) -> None:
        """See :meth:`CachePolicy.insert`; new entries are the most recent."""
        self._entries[key] = entry

    def remove(self, key: OffloadKey) -> None:
        """See :meth:`CachePolicy.remove`."""
        self._entries.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """See :meth:`CachePolicy.touch`."""
        for key in reversed(keys):
            if key in self._entries:
                self._entries.move_to_end(key)

    def on_access(self, keys: Sequence[OffloadKey]) -> None:
        """Most recent at once, head of the prefix last (vLLM 0.33 ranks them by the
        request and their position): a request's loads are not evicted by its own stores."""
        self.touch(keys)

    def evict(self, n: int, protected: Collection[OffloadKey]) -> Victims | None:
        """See :meth:`CachePolicy.evict`; scans from the least recent end."""
        if n <= 0:
            return []
        picked: list[OffloadKey] = []
        for key, entry in self._entries.items():
            if entry.ref_cnt == 0 and key not in protected:  # is_evictable, inlined
                picked.append(key)
                if len(picked) == n:
                    break
        if len(picked) < n:
            return None
        return [(key, self._entries.pop(key)) for key in picked]

    def clear(self) -> None:
        """See :meth:`CachePolicy.clear`."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[tuple[OffloadKey, SlotEntry]]:
        return iter(list(self._entries.items()))
