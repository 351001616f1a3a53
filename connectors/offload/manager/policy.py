"""The cache-policy interface of the CPU offloading tier and its records.

Ref counts follow the manager's convention: ``-1`` = being written (not readable, not
evictable), ``0`` = ready and evictable, ``> 0`` = pinned by that many loads.

``evict`` is atomic: it either returns exactly ``n`` victims (already removed from the
policy) or ``None`` having changed nothing, so a refused store leaves no trace.

Primitives: :data:`OffloadKey`, :class:`SlotEntry`, :class:`RequestAccess` (one request's
uses), :class:`CachePolicy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NewType

__all__ = ["CachePolicy", "OffloadKey", "RequestAccess", "SlotEntry"]

OffloadKey = NewType("OffloadKey", bytes)
"""Key of an offloaded chunk: the chained hash of the last GPU block it holds, then its KV
cache group as 4 big-endian bytes. A NewType: bytes at run time, its own type for mypy."""


@dataclass(slots=True)
class SlotEntry:
    """One offloaded block held by the tier.

    Attributes:
        slot_id: index of the block in the tier's buffer.
        ref_cnt: -1 while being written, 0 when ready, > 0 while pinned by loads.
    """

    slot_id: int
    ref_cnt: int = -1

    @property
    def is_ready(self) -> bool:
        """True once the block's bytes are complete (it may be read)."""
        return self.ref_cnt >= 0

    @property
    def is_evictable(self) -> bool:
        """True when the block is ready and no load pins it."""
        return self.ref_cnt == 0


@dataclass(slots=True)
class RequestAccess:
    """One request's uses of the tier, as vLLM 0.33's manager records them per request.

    Filled by :meth:`CPUOffloadingManager.prepare_load` and ``prepare_store`` when the
    caller passes it, and committed by :meth:`OffloadingManager.finish_request`.

    Attributes:
        position: each key's position in the request (its end token, or any number
            that grows along the prefix), set by the caller before offering keys: a
            policy that ranks by request (LRU) evicts a request's tail first.
        rank: the request's recency rank, given by such a policy on its first use
            (0: none yet).
        seen: every key it loaded or offered for storing while absent or held ready,
            in the order first seen (the caller sorts them into prefix order at finish).
        reused: keys of ``seen`` it loaded or found held ready (not counting the keys it
            stored itself first: reading back one's own store is no second use).
        inserted: keys it got a slot for.
        missed: keys whose store miss the policy learned from already; a store that is
            refused and offered again is one observation, not one per retry.
    """

    position: dict[OffloadKey, int] = field(default_factory=dict)
    seen: dict[OffloadKey, None] = field(default_factory=dict)
    reused: set[OffloadKey] = field(default_factory=set)
    inserted: set[OffloadKey] = field(default_factory=set)
    missed: set[OffloadKey] = field(default_factory=set)
    rank: int = 0

    @property
    def stored_only(self) -> set[OffloadKey]:
        """Keys it stored and did not reuse (a store is not a second use)."""
        return self.inserted - self.reused


Victims = list[tuple[OffloadKey, SlotEntry]]


class CachePolicy(ABC):
    """Orders the live entries of one tier and picks eviction victims.

    Args:
        capacity: number of slots of the tier (bounds ghost state, if any).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> SlotEntry | None:
        """Return the live entry of ``key``, or None when the tier does not hold it."""

    @abstractmethod
    def insert(self, key: OffloadKey, entry: SlotEntry, access: RequestAccess | None = None
               ) -> None:
        """Add a new live entry (the caller guarantees ``key`` is not present), stored by
        the request of ``access`` when given."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Drop a live entry without recording it as evicted (no ghost is kept)."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark ``keys`` as used now; absent keys are ignored (or adapt ghost state).

        Keys are processed in reverse so that the head of a prefix ends up the most
        recent and the tail is evicted first.
        """

    def on_access(self, keys: Sequence[OffloadKey],  # noqa: B027 - optional hook
                  access: RequestAccess | None = None) -> None:
        """The request of ``access`` sees ``keys`` for the first time (a load, or a store
        offer; absent keys are to be ignored), in prefix order. Default: nothing (vLLM
        0.33's ARC waits for the finish; its LRU ranks them at once, see
        :meth:`LRUCachePolicy.on_access`)."""

    def on_request_finished(self, keys: Sequence[OffloadKey], reused: Collection[OffloadKey],
                            stored: Collection[OffloadKey] | None = None) -> None:
        """Commit one finished request's recency, as vLLM 0.33's ``on_request_finished``.

        Args:
            keys: every key the request loaded, stored, or offered while it was absent
                or held ready, head of the prefix first.
            reused: those of ``keys`` it loaded or found held.
            stored: those it only stored (None: every key not in ``reused``); keys in
                neither were offered and not stored (a refused store).

        Default: :meth:`touch` of all ``keys``.
        """
        self.touch(keys)

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 - optional hook
        """Learn from ``keys`` being offered for storing while the tier does not hold them.

        Called by the manager's ``prepare_store`` before it evicts, also when the store
        is then refused. A policy that adapts (ARC) uses it: under the offload protocol
        a block that left the tier is usually *stored again*, not looked up again, so a
        store miss is where the re-reference of an evicted key shows. Default: nothing.
        """

    @abstractmethod
    def evict(self, n: int, protected: Collection[OffloadKey]) -> Victims | None:
        """Remove and return ``n`` evictable entries not in ``protected``.

        Returns:
            The victims in eviction order, or None (nothing changed) when fewer than
            ``n`` entries can be evicted.
        """

    @abstractmethod
    def clear(self) -> None:
        """Forget every entry and all adaptive state."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of live entries."""

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[OffloadKey, SlotEntry]]:
        """Iterate over live entries, least valuable first."""
