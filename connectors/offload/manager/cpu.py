"""Scheduler side of the CPU offloading tier: which blocks the tier holds, and where.

Primitives:
    LoadStoreSpec        slot ids of one transfer, in key order (crosses to the worker)
    PrepareStoreOutput   what ``prepare_store`` decided: keys to write, their slots, victims
    OffloadingEvent      keys stored in / removed from a medium (no block size: the
                         connector knows the block geometry and adds it on the wire)
    OffloadingManager    ABC: lookup / prepare_load / touch / complete_load /
                         prepare_store / complete_store / take_events / ready_keys
    CPUOffloadingManager slot allocator + ref counts over a pluggable cache policy

Lifecycle of a stored block: ``prepare_store`` gives it a slot at ref -1 (invisible to
``lookup``); ``complete_store(success=True)`` makes it ready (ref 0, evictable) and emits
one stored event per batch; ``complete_store(success=False)`` frees the slot and the
key never becomes visible. ``prepare_load`` pins ready blocks (ref > 0) until
``complete_load``; pinned or in-flight blocks are never evicted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Sequence

import msgspec

from connectors.offload.manager.policy import OffloadKey, RequestAccess, SlotEntry
from connectors.offload.manager.registry import get_cache_policy
from kvconnector_core.errors import ConfigError, InvariantError

__all__ = [
    "CPUOffloadingManager",
    "LoadStoreSpec",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
]


class LoadStoreSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Where the blocks of one transfer live in an offloading medium.

    Attributes:
        block_ids: slot ids in the medium, in the order of the keys they belong to.
        medium: name of the medium (``"CPU"``).
    """

    block_ids: tuple[int, ...]
    medium: str = "CPU"


class PrepareStoreOutput(msgspec.Struct, frozen=True, kw_only=True):
    """Result of :meth:`OffloadingManager.prepare_store`.

    Attributes:
        keys_to_store: the keys that must be written (not already held), in input order.
        store_spec: one slot per key of ``keys_to_store``, same order.
        evicted_keys: keys evicted to make room (already gone from the tier).
        reused_keys: the keys offered that the tier already holds ready, in input
            order (a reuse for recency, see :meth:`OffloadingManager.finish_request`).
    """

    keys_to_store: tuple[OffloadKey, ...]
    store_spec: LoadStoreSpec
    evicted_keys: tuple[OffloadKey, ...]
    reused_keys: tuple[OffloadKey, ...] = ()


class OffloadingEvent(msgspec.Struct, frozen=True):
    """Keys that became available in, or were removed from, an offloading medium.

    Attributes:
        keys: the affected keys, in the order they were stored / evicted.
        medium: the medium (``"CPU"``).
        removed: True for a removal, False for a store.
    """

    keys: tuple[OffloadKey, ...]
    medium: str
    removed: bool


class OffloadingManager(ABC):
    """Bookkeeping of one offloading tier; runs in the scheduler, moves no bytes.

    Required operations are abstract; ``touch``, ``complete_load`` and ``take_events``
    have no-op defaults for tiers that need no recency, pinning or events.
    """

    @abstractmethod
    def lookup(self, keys: Iterable[OffloadKey]) -> int:
        """Return how many leading ``keys`` are held and ready to load."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey], access: RequestAccess | None = None
                     ) -> LoadStoreSpec:
        """Pin ``keys`` (all held and ready) until :meth:`complete_load`; a reuse for
        ``access`` (recorded as a use now, see :meth:`record_access`) when given.

        Returns:
            The slots of ``keys``, in key order.

        Raises:
            InvariantError: a key is absent or not ready.
        """

    def touch(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 - optional hook
        """Record a use of ``keys`` (hits on any tier); absent keys are ignored."""

    def record_access(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 - optional hook
        """A request uses held ``keys`` now (it loads them, or offered them for storing
        while they were held), head of the prefix first; see :meth:`finish_request`."""

    def finish_request(  # noqa: B027 - optional hook, a no-op by default
            self, keys: Sequence[OffloadKey], reused: Collection[OffloadKey],
            stored: Collection[OffloadKey] | None = None) -> None:
        """Commit a finished request's recency, the way vLLM 0.33's manager does.

        Args:
            keys: every key the request loaded, stored, or offered while it was held
                ready, head of the prefix first (a :class:`RequestAccess`'s ``seen``).
            reused: those of ``keys`` it loaded or found held.
            stored: those it only stored (None: every key of ``keys`` not in ``reused``).
        """

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027
        """Unpin ``keys`` after their load finished (successfully or not)."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey], access: RequestAccess | None = None
                      ) -> PrepareStoreOutput | None:
        """Reserve slots for the ``keys`` not yet held, evicting if needed.

        Keys already held are never stored again, and every key passed in is protected
        from this call's evictions.

        Args:
            keys: the keys offered, head of the prefix first.
            access: the offering request's record (updated, also when the store is
                refused): the keys found held ready are reuses, recorded as a use now;
                the policy learns from each of its store misses once. None: no
                request record, every miss is reported.

        Returns:
            The plan, or None (nothing changed) when not enough space can be freed.
        """

    @abstractmethod
    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """Finish a store: make ``keys`` readable, or drop them if ``success`` is False."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Return and forget the events recorded since the last call."""
        return ()

    def ready_keys(self) -> list[OffloadKey]:
        """Return every key the tier holds ready to load (what a consumer of its events should see).

        Event snapshots (:func:`connectors.offload.events.snapshot_events`) are built
        from it, so a tier that records events must implement it.

        Raises:
            NotImplementedError: by default; a snapshot that cannot be built is
                retried by the engine rather than sent wrong.
        """
        msg = (f"{type(self).__name__} does not implement ready_keys(), so its events cannot "
               "be resynced")
        raise NotImplementedError(msg)


class CPUOffloadingManager(OffloadingManager):
    """Offloading manager of a fixed number of CPU slots.

    Slots are handed out fresh in ascending order first, then reused last-freed-first,
    which keeps a cold cache's writes contiguous (one DMA run per store batch).

    Args:
        num_blocks: number of slots (offloaded blocks) of the tier.
        cache_policy: name of a registered policy (``"lru"`` or ``"arc"`` built in).
        enable_events: record :class:`OffloadingEvent` for :meth:`take_events`.
        medium: medium name put on specs and events.

    Raises:
        ConfigError: ``num_blocks`` is not positive or the policy is unknown.
    """

    def __init__(
        self,
        num_blocks: int,
        cache_policy: str = "lru",
        enable_events: bool = False,
        *,
        medium: str = "CPU",
    ) -> None:
        if num_blocks <= 0:
            msg = f"num_blocks must be a positive number of CPU blocks, got {num_blocks!r}"
            raise ConfigError(msg)
        self.num_blocks = num_blocks
        self.medium = medium
        self.policy = get_cache_policy(cache_policy)(num_blocks)
        # Every key the policy holds, with its entry: the policy's membership as a plain
        # dict, so the per-key lookups of lookup / prepare_store / complete_store are C
        # calls instead of a policy method each (ARC looks in two lists). Changed only
        # where the policy's membership changes: insert, evict, remove, clear.
        self._held: dict[OffloadKey, SlotEntry] = {}
        self._enable_events = enable_events
        self._events: list[OffloadingEvent] = []
        self._num_fresh = 0  # slots [0, _num_fresh) have been handed out at least once
        self._free_list: list[int] = []
        self._num_evictable = 0  # entries at ref 0
        self.version = 0
        """Bumped whenever a key becomes ready or stops being held (see :meth:`lookup`)."""
        self.num_stores_skipped = 0  # keys offered that were already held

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Slots not holding any block."""
        return self.num_blocks - self._num_fresh + len(self._free_list)

    @property
    def num_evictable_blocks(self) -> int:
        """Held blocks that are ready and not pinned."""
        return self._num_evictable

    @property
    def usage(self) -> float:
        """Fraction of slots holding a block (ready or being written)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, keys: Iterable[OffloadKey]) -> int:
        """See :meth:`OffloadingManager.lookup`; the answer for the same keys stays the same
        until :attr:`version` changes."""
        # One call per chunk of a hit (it walks the whole hit): the bound method once, and
        # ``ref_cnt`` read directly (``is_ready`` is ``ref_cnt >= 0``).
        get = self._held.get
        hits = 0
        for key in keys:
            entry = get(key)
            if entry is None or entry.ref_cnt < 0:
                break
            hits += 1
        return hits

    # ------------------------------------------------------------------ loads
    def prepare_load(self, keys: Sequence[OffloadKey], access: RequestAccess | None = None
                     ) -> LoadStoreSpec:
        """See :meth:`OffloadingManager.prepare_load`."""
        entries = [self._ready_entry(key) for key in keys]  # validate all before pinning
        for entry in entries:
            if entry.ref_cnt == 0:
                self._num_evictable -= 1
            entry.ref_cnt += 1
        if access is not None:
            self._observe(access, keys, keys)
        return LoadStoreSpec(block_ids=tuple(e.slot_id for e in entries), medium=self.medium)

    def _ready_entry(self, key: OffloadKey) -> SlotEntry:
        entry = self._held.get(key)
        if entry is None or not entry.is_ready:
            state = "absent" if entry is None else "still being written"
            msg = f"prepare_load: key {key.hex()[:16]} is {state}; lookup() must hit first"
            raise InvariantError(msg)
        return entry

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """See :meth:`OffloadingManager.touch`."""
        self.policy.touch(keys)

    def record_access(self, keys: Sequence[OffloadKey]) -> None:
        """See :meth:`OffloadingManager.record_access`."""
        self.policy.on_access(keys, None)

    def _observe(self, access: RequestAccess, keys: Sequence[OffloadKey],
                 reused: Sequence[OffloadKey]) -> None:
        # vLLM 0.33's per-request record: the policy sees a key's first use by a request
        # at once (LRU ranks it), the rest waits for finish_request.
        seen = access.seen
        new = [k for k in keys if k not in seen]
        if new:
            seen.update(dict.fromkeys(new))
            self.policy.on_access(new, access)
        inserted = access.inserted
        access.reused.update(k for k in reused if k not in inserted)

    def finish_request(self, keys: Sequence[OffloadKey], reused: Collection[OffloadKey],
                       stored: Collection[OffloadKey] | None = None) -> None:
        """See :meth:`OffloadingManager.finish_request`."""
        self.policy.on_request_finished(keys, reused, stored)

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """See :meth:`OffloadingManager.complete_load`.

        Raises:
            InvariantError: a key is not pinned by a load.
        """
        get = self._held.get
        for key in keys:
            entry = get(key)
            if entry is None or entry.ref_cnt <= 0:
                msg = f"complete_load: key {key.hex()[:16]} has no load in flight"
                raise InvariantError(msg)
            entry.ref_cnt -= 1
            if entry.ref_cnt == 0:
                self._num_evictable += 1

    # ------------------------------------------------------------------ stores
    def prepare_store(self, keys: Sequence[OffloadKey], access: RequestAccess | None = None
                      ) -> PrepareStoreOutput | None:
        """See :meth:`OffloadingManager.prepare_store`."""
        held = self._held
        get = held.get
        new_keys: list[OffloadKey] = []
        reused: list[OffloadKey] = []
        for k in keys:
            entry = get(k)
            if entry is None:
                new_keys.append(k)
            elif entry.ref_cnt >= 0:  # held and ready (one still being written is no reuse)
                reused.append(k)
        if len(new_keys) > 1:
            new_keys = list(dict.fromkeys(new_keys))
        self.num_stores_skipped += len(keys) - len(new_keys)
        # Before evicting, and also when the store is then refused (as vLLM 0.33 does):
        # an adaptive policy learns from the keys it no longer holds, once per request.
        if access is None:
            self.policy.on_store_miss(new_keys)
        else:
            self._note_offer(access, keys, new_keys, reused)
        need = len(new_keys) - self.num_free_blocks
        evicted: list[OffloadKey] = []
        if need > 0:
            # Cheap refusal first: the policy could not succeed anyway.
            if need > self._num_evictable:
                return None
            victims = self.policy.evict(need, frozenset(keys))
            if victims is None:
                return None
            free_list = self._free_list
            for key, entry in victims:
                free_list.append(entry.slot_id)
                evicted.append(key)
                del held[key]
            self._num_evictable -= len(evicted)
            self._record(evicted, removed=True)
        slot_ids = self._allocate_slots(len(new_keys))
        insert = self.policy.insert
        for key, slot_id in zip(new_keys, slot_ids):
            entry = SlotEntry(slot_id, -1)
            held[key] = entry
            insert(key, entry, access)
        if access is not None:
            access.inserted.update(new_keys)
        return PrepareStoreOutput(
            keys_to_store=tuple(new_keys),
            store_spec=LoadStoreSpec(block_ids=tuple(slot_ids), medium=self.medium),
            evicted_keys=tuple(evicted),
            reused_keys=tuple(reused),
        )

    def _note_offer(self, access: RequestAccess, keys: Sequence[OffloadKey],
                    new_keys: list[OffloadKey], reused: list[OffloadKey]) -> None:
        # Before any refusal: the misses the request has not reported yet, then the
        # offered keys that are absent or held ready, in offer order.
        missed = access.missed
        fresh = [k for k in new_keys if k not in missed]
        if fresh:
            self.policy.on_store_miss(fresh)
            missed.update(fresh)
        if reused:
            recorded = {*new_keys, *reused}
            self._observe(access, [k for k in keys if k in recorded], reused)
        else:
            self._observe(access, new_keys, ())

    def _allocate_slots(self, n: int) -> list[int]:
        # Fresh slots first (ascending), then the most recently freed ones.
        fresh = min(n, self.num_blocks - self._num_fresh)
        slots = list(range(self._num_fresh, self._num_fresh + fresh))
        self._num_fresh += fresh
        rest = n - fresh
        if rest:
            free_list = self._free_list
            if rest > len(free_list):  # prepare_store counted free slots; cannot happen
                msg = "CPUOffloadingManager: no free slot after eviction"
                raise InvariantError(msg)
            slots += reversed(free_list[-rest:])
            del free_list[-rest:]
        return slots

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """See :meth:`OffloadingManager.complete_store`.

        Keys that are absent or already ready are ignored, so a retry or a duplicate
        report is harmless. A failed store emits no event: it was never visible.
        """
        done: list[OffloadKey] = []
        get = self._held.get
        for key in keys:
            entry = get(key)
            if entry is None or entry.ref_cnt != -1:
                continue
            if success:
                entry.ref_cnt = 0
                self._num_evictable += 1
                done.append(key)
            else:
                self.policy.remove(key)
                del self._held[key]
                self._free_list.append(entry.slot_id)
        if done:
            self._record(done, removed=False)

    # ------------------------------------------------------------------ events / reset
    def _record(self, keys: Sequence[OffloadKey], *, removed: bool) -> None:
        # Every change of which keys are ready passes here (stores completed, evictions,
        # resets): lookups cached against ``version`` are stale after it.
        if keys:
            self.version += 1
        if self._enable_events and keys:
            self._events.append(OffloadingEvent(tuple(keys), self.medium, removed))

    def take_events(self) -> list[OffloadingEvent]:
        """See :meth:`OffloadingManager.take_events`."""
        events, self._events = self._events, []
        return events

    def ready_keys(self) -> list[OffloadKey]:
        """See :meth:`OffloadingManager.ready_keys`; in the policy's order.

        Keys being written (ref -1) are left out: their stored event comes with
        ``complete_store``, after any snapshot taken now.
        """
        return [key for key, entry in self.policy if entry.is_ready]

    def reset_cache(self) -> bool:
        """Drop every block, unless a load or store is in flight.

        Returns:
            True if the tier was cleared (one removal event for the ready blocks),
            False if some block is pinned or being written (nothing changed).
        """
        entries = list(self.policy)
        if any(e.ref_cnt != 0 for _, e in entries):
            return False
        self._record([k for k, _ in entries], removed=True)
        self.policy.clear()
        self._held.clear()
        self._num_fresh = 0
        self._free_list.clear()
        self._num_evictable = 0
        return True
