"""The cache-policy interface of the CPU offloading tier and its records.

Ref counts follow the manager's convention: ``-1`` = being written (not readable, not
evictable), ``0`` = ready and evictable, ``> 0`` = pinned by that many loads.

``evict`` is atomic: it either returns exactly ``n`` victims (already removed from the
policy) or ``None`` having changed nothing, so a refused store leaves no trace.

Primitives: :data:`OffloadKey`, :class:`SlotEntry`, :class:`CachePolicy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import NewType

__all__ = ["CachePolicy", "OffloadKey", "SlotEntry"]

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
    def insert(self, key: OffloadKey, entry: SlotEntry) -> None:
        """Add a new live entry (the caller guarantees ``key`` is not present)."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Drop a live entry without recording it as evicted (no ghost is kept)."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark ``keys`` as used now; absent keys are ignored (or adapt ghost state).

        Keys are processed in reverse so that the head of a prefix ends up the most
        recent and the tail is evicted first.
        """

    def on_access(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 - optional hook
        """A request uses held ``keys`` now (a load, or a store offer of keys already
        held), in prefix order. Default: nothing (vLLM 0.33's ARC waits for the finish;
        its LRU ranks them at once, see :meth:`LRUCachePolicy.on_access`)."""

    def on_request_finished(self, keys: Sequence[OffloadKey], reused: Collection[OffloadKey]
                            ) -> None:
        """Commit one finished request's recency, as vLLM 0.33's ``on_request_finished``.

        Args:
            keys: every key the request loaded, stored, or offered while it was held and
                ready, head of the prefix first.
            reused: those of ``keys`` it loaded or found held (the others it stored).

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
