"""The ARC cache policy of the CPU offloading tier."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from itertools import islice

from connectors.offload.manager.policy import (
    CachePolicy,
    OffloadKey,
    RequestAccess,
    SlotEntry,
    Victims,
)

__all__ = ["ARCCachePolicy"]


class ARCCachePolicy(CachePolicy):
    """Adaptive replacement cache (Megiddo & Modha), adapted to pinned entries.

    Live entries sit in T1 (seen once) or T2 (seen again); evicted keys are remembered
    in the ghost lists B1 / B2, each bounded by ``capacity``. ``target`` is the size T1
    should have: a re-reference of a B1 ghost raises it (recency is paying off), one of
    a B2 ghost lowers it.

    A re-reference of a ghost shows in two places:

    - :meth:`touch` of a key that is a ghost (a hit the GPU prefix cache served while
      the tier had evicted the key), as in the classic algorithm;
    - :meth:`on_store_miss`, which ``prepare_store`` calls for the keys it is asked to
      store and does not hold, as vLLM 0.33 does. Our connector touches only the keys
      a request hits, so without this the ghosts of the blocks it stores again would
      never be seen and the target would stay at 0.

    A stored key enters T1 even when it comes back from a ghost list (as in vLLM 0.33;
    Megiddo & Modha put it in T2). Measured on the reference chat trace
    (``benchmarks/bench_offload_hits.py``), T2 insertion lost 3-15 points of hit rate:
    blocks that are only ever stored again, never hit, crowded out of T2 the blocks
    that lookups actually hit.

    Attributes:
        target: the adaptive target size of T1, in ``[0, capacity]``.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target = 0.0
        self._t1: OrderedDict[OffloadKey, SlotEntry] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, SlotEntry] = OrderedDict()
        # Ghost keys, oldest first (the values are unused).
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()

    # Read-only views for tests and diagnostics.
    @property
    def t1(self) -> tuple[OffloadKey, ...]:
        """Keys of T1, least recent first."""
        return tuple(self._t1)

    @property
    def t2(self) -> tuple[OffloadKey, ...]:
        """Keys of T2, least recent first."""
        return tuple(self._t2)

    @property
    def b1(self) -> tuple[OffloadKey, ...]:
        """Ghost keys evicted from T1, oldest first."""
        return tuple(self._b1)

    @property
    def b2(self) -> tuple[OffloadKey, ...]:
        """Ghost keys evicted from T2, oldest first."""
        return tuple(self._b2)

    def get(self, key: OffloadKey) -> SlotEntry | None:
        """See :meth:`CachePolicy.get`."""
        entry = self._t1.get(key)
        return entry if entry is not None else self._t2.get(key)

    def insert(self, key: OffloadKey, entry: SlotEntry, access: RequestAccess | None = None
               ) -> None:
        """See :meth:`CachePolicy.insert`; a new key enters T1 and leaves the ghosts."""
        self._t1[key] = entry
        self._b1.pop(key, None)
        self._b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        """See :meth:`CachePolicy.remove`."""
        if self._t1.pop(key, None) is None:
            self._t2.pop(key, None)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """See :meth:`CachePolicy.touch`; promotes ready T1 hits and adapts the target."""
        for key in reversed(keys):
            entry = self._t1.get(key)
            if entry is not None:
                if entry.is_ready:
                    # Second use: the block is frequency-worthy.
                    del self._t1[key]
                    self._t2[key] = entry
                else:
                    # Still being written: a re-offer is not a re-use.
                    self._t1.move_to_end(key)
            elif key in self._t2:
                self._t2.move_to_end(key)
            else:
                self._ghost_hit(key)

    def on_request_finished(self, keys: Sequence[OffloadKey], reused: Collection[OffloadKey],
                            stored: Collection[OffloadKey] | None = None) -> None:
        """See :meth:`CachePolicy.on_request_finished`; vLLM 0.33's rule, tail first: a
        key the request only stored moves to the end of its own list (a store is not a
        second use); a reused key is promoted (T1 -> T2, or to T2's end); other keys
        (offered, not stored) and ghosts are left alone."""
        t1, t2 = self._t1, self._t2
        for key in reversed(keys):
            if key in reused:
                entry = t1.pop(key, None)
                if entry is not None:
                    t2[key] = entry
                elif key in t2:
                    t2.move_to_end(key)
            elif stored is not None and key not in stored:
                continue
            elif key in t1:
                t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        """See :meth:`CachePolicy.on_store_miss`; adapts the target on ghost keys, tail of
        the prefix first, as vLLM 0.33 does. The manager reports a request's miss once
        (its ``missed`` set), so a store refused and offered again adapts once."""
        for key in reversed(keys):
            self._ghost_hit(key)

    def _ghost_hit(self, key: OffloadKey) -> bool:
        """Adapt the target if ``key`` is a ghost (classic ARC's cases II and III)."""
        if key in self._b1:
            step = max(1.0, len(self._b2) / len(self._b1))
            self.target = min(self.target + step, float(self.capacity))
            self._b1.move_to_end(key)
            return True
        if key in self._b2:
            step = max(1.0, len(self._b1) / len(self._b2))
            self.target = max(self.target - step, 0.0)
            self._b2.move_to_end(key)
            return True
        return False

    def evict(self, n: int, protected: Collection[OffloadKey]) -> Victims | None:
        """See :meth:`CachePolicy.evict`.

        Victims are chosen by simulation first (so a shortfall changes nothing): while
        T1 is at least its target, take T1's least recent evictable entry, else T2's;
        fall back to the other list when the preferred one has nothing evictable.
        """
        if n <= 0:
            return []
        t1_iter = self._evictable(self._t1, protected)
        t1_size = len(self._t1)
        if n - 1 <= t1_size - int(self.target):
            # Every pick prefers T1 (T1 stays at or above the target until the last one):
            # when T1 has n evictable entries they are the victims, taken in one pass.
            keys = list(islice(t1_iter, n))
            if len(keys) == n:
                return self._take(keys, self._t1, self._b1)
            t1_iter = self._evictable(self._t1, protected)
        t2_iter = self._evictable(self._t2, protected)
        picks: list[tuple[bool, OffloadKey]] = []  # (from_t1, key)
        for _ in range(n):
            key = next(t1_iter, None) if t1_size >= int(self.target) else None
            from_t1 = key is not None
            if key is None:
                key = next(t2_iter, None)
            if key is None:
                key = next(t1_iter, None)
                from_t1 = key is not None
            if key is None:
                return None
            if from_t1:
                t1_size -= 1
            picks.append((from_t1, key))
        victims: Victims = []
        for from_t1, key in picks:
            live, ghost = (self._t1, self._b1) if from_t1 else (self._t2, self._b2)
            victims.append((key, live.pop(key)))
            ghost[key] = None
        for ghost in (self._b1, self._b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return victims

    def _take(self, keys: list[OffloadKey], live: OrderedDict[OffloadKey, SlotEntry],
              ghost: OrderedDict[OffloadKey, None]) -> Victims:
        # Evict ``keys`` (all in ``live``) into ``ghost``, then bound the ghost list.
        pop = live.pop
        victims: Victims = [(key, pop(key)) for key in keys]
        ghost.update(dict.fromkeys(keys))
        while len(ghost) > self.capacity:
            ghost.popitem(last=False)
        return victims

    @staticmethod
    def _evictable(
        entries: OrderedDict[OffloadKey, SlotEntry], protected: Collection[OffloadKey]
    ) -> Iterator[OffloadKey]:
        # A generator over the live dict: safe because nothing is removed until the
        # simulation in evict() has finished.
        # (``ref_cnt == 0`` is ``SlotEntry.is_evictable``, read directly on this hot path.)
        return (k for k, e in entries.items() if e.ref_cnt == 0 and k not in protected)

    def clear(self) -> None:
        """See :meth:`CachePolicy.clear`; also resets the target."""
        self.target = 0.0
        for d in (self._t1, self._t2, self._b1, self._b2):
            d.clear()

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __iter__(self) -> Iterator[tuple[OffloadKey, SlotEntry]]:
        return iter([*self._t1.items(), *self._t2.items()])
