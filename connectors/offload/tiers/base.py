"""The secondary-tier interface: what sits behind the CPU tier (local disk, Redis, ...).

A secondary tier stores opaque block values under :class:`TierKey` s and never touches
GPU memory: the caller hands it bytes copied out of the CPU tier and gets bytes back to
put into the CPU tier. Every public method is non-blocking; the I/O runs on the tier's
own threads:

- :meth:`SecondaryTier.lookup` answers how many leading keys of a chain the tier holds,
  and :meth:`SecondaryTier.lookup_each` which keys it holds (a sliding-window group needs
  chunks after a gap), or None ("ask again") while the I/O that finds out is still running.
- :meth:`SecondaryTier.store` queues values; when more stores are pending than the tier
  allows (it is slower than the store rate) the new ones are dropped and counted. A
  store that fails is never visible: backends publish a value atomically or not at all.
- :meth:`SecondaryTier.load` returns a :class:`TierLoad`; each value is bytes, or None
  when it is missing, unreadable, or fails its checksum (the caller recomputes it).
  :meth:`SecondaryTier.load_into` reads straight into the caller's buffers (a CPU slot).

Values are framed (:mod:`connectors.offload.tiers.frame`) with a magic, the payload length and a
CRC-32 over the key and the payload, so a truncated, corrupted or misplaced value is a failed
load, never wrong data.
(CRC-32 catches accidental damage, which is what it is for here; it runs at ~3 GB/s where
BLAKE2b ran at 0.3 GB/s on the benchmark machine, and would have halved tier throughput.
Keeping a hostile writer out is the job of Redis ACLs and file permissions.) Backends
implement four blocking methods (``_held``, ``_put``, ``_get``, ``_close``), may override
``_get_into`` to read into buffers directly, and see only framed bytes.

Primitives: :class:`SecondaryTier`, :func:`make_tiers` (the records :class:`TierKey`,
:class:`Shard`, :class:`TierLoad`, :class:`TierEvent` are in
:mod:`connectors.offload.tiers.records`).
"""

from __future__ import annotations

import itertools
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, Self

from connectors.offload.tiers.frame import (
    ABSENT,
    DAMAGED,
    FAILED,
    OTHER_SIZE,
    PLACED,
    frame_header,
    intact_payload,
    unframe_value,
)
from connectors.offload.tiers.records import Shard, TierEvent, TierKey, TierLoad
from kvconnector_core.errors import ConfigError

__all__ = ["SecondaryTier", "make_tiers"]

logger = logging.getLogger(__name__)


class SecondaryTier(ABC):
    """Base of every secondary tier: threads, back-pressure, checksums, stats, events.

    Args:
        max_pending_stores: store batches that may wait for I/O; more are dropped.
        io_threads: threads doing the tier's I/O.
        enable_events: record stored / removed keys for :meth:`take_events`.
        shard: the worker shard whose keys this instance writes (None: one worker, or a
            scheduler side that only looks up); a backend that keeps an index of what it
            holds (the disk tier's size budget) indexes only that shard's keys.
    """

    medium: ClassVar[str] = "STORAGE"
    """Medium name in KV events and stats (``"DISK"``, ``"REDIS"``)."""

    max_announced: ClassVar[int | None] = None
    """Bound on the keys remembered as announced (None: the backend's own bound). A tier
    that evicts silently needs one; past it the oldest key is removed from the stream."""

    def __init__(self, *, max_pending_stores: int = 64, io_threads: int = 2,
                 enable_events: bool = True, shard: Shard | None = None) -> None:
        for name, value in (("max_pending_stores", max_pending_stores), ("io_threads", io_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"{type(self).__name__} {name} must be a positive int, got {value!r}"
                raise ConfigError(msg)
        self.shard = shard
        self._max_pending = max_pending_stores
        self._io_threads = io_threads
        self._pool = ThreadPoolExecutor(io_threads,
                                        thread_name_prefix=f"kv-tier-{self.medium.lower()}")
        self._lock = threading.Lock()  # guards everything below; I/O threads update it
        self._idle = threading.Condition(self._lock)  # notified when a store batch ends
        self._pending_stores = 0
        self._lookups: dict[Hashable, Future[list[bool]]] = {}
        self._events: list[TierEvent] = []
        self._announced: dict[TierKey, None] = {}  # held keys whose stored event went out
        self._enable_events = enable_events
        self._stats = dict.fromkeys(
            ("stores", "stores_dropped", "store_failures", "bytes_stored", "loads",
             "load_failures", "bytes_loaded", "lookups", "lookup_failures"), 0)
        # Operation kinds ("lookup", "store", "load") whose last attempt failed: a tier that
        # is down fails every operation, and one log line per failure would flood stderr.
        self._failing: set[str] = set()
        self._closed = False

    # ---------------------------------------------------------------- backend interface
    @abstractmethod
    def _held(self, keys: Sequence[TierKey]) -> list[bool]:
        """Blocking: which ``keys`` the backend holds (one round trip if it can)."""

    @abstractmethod
    def _put(self, items: Sequence[tuple[TierKey, Sequence[bytes | memoryview]]]) -> None:
        """Blocking: store framed values (each given as consecutive parts: frame header,
        payload), each atomically; raise if any failed."""

    @abstractmethod
    def _get(self, keys: Sequence[TierKey]) -> list[bytes | None]:
        """Blocking: the framed values of ``keys`` (None where absent)."""

    def _close(self) -> None:  # noqa: B027 - optional hook
        """Release backend resources (connections)."""

    def _get_into(self, keys: Sequence[TierKey], dests: Sequence[Sequence[memoryview]]
                  ) -> list[str]:
        """Blocking: put each key's payload into its buffers if its value is intact and
        fills them exactly; per key one of PLACED, ABSENT, DAMAGED, OTHER_SIZE.

        This default reads with ``_get`` and copies once; a backend that can read into
        the buffers directly overrides it.
        """
        out = []
        for key, dest, raw in zip(keys, dests, self._get(keys), strict=True):
            payload = intact_payload(key, raw)
            if payload is None:
                out.append(ABSENT if raw is None else DAMAGED)
            elif len(payload) != sum(d.nbytes for d in dest):
                out.append(OTHER_SIZE)
            else:
                offset = 0
                for d in dest:
                    d[:] = payload[offset:offset + d.nbytes]
                    offset += d.nbytes
                out.append(PLACED)
        return out

    # ---------------------------------------------------------------- public API
    def lookup(self, keys: Sequence[TierKey], token: Hashable | None = None) -> int | None:
        """How many leading ``keys`` the tier holds, or None: ask again later.

        The first call for a chain starts the I/O and answers None; a later call with the
        same ``token`` (default: the keys themselves) answers once the I/O is done. A
        failed lookup answers 0 (a miss). Never blocks.
        """
        if not keys:
            return 0
        held = self.lookup_each(keys, token)
        if held is None:
            return None
        return next((i for i, h in enumerate(held) if not h), len(held))

    def lookup_each(self, keys: Sequence[TierKey], token: Hashable | None = None
                    ) -> list[bool] | None:
        """Which ``keys`` the tier holds, or None: ask again later (see :meth:`lookup`).

        A key whose lookup failed counts as not held (a miss). Never blocks.
        """
        if not keys:
            return []
        token = tuple(keys) if token is None else token
        with self._lock:
            future = self._lookups.get(token)
            if future is None:
                self._lookups[token] = self._pool.submit(self._lookup_io, tuple(keys))
                return None
            if not future.done():
                return None
            del self._lookups[token]
        return future.result()

    def cancel_lookup(self, token: Hashable) -> None:
        """Forget a lookup whose answer is no longer wanted (e.g. the request finished)."""
        with self._lock:
            self._lookups.pop(token, None)

    def store(self, items: Sequence[tuple[TierKey, bytes | memoryview]]) -> bool:
        """Queue ``items`` (key, payload) for storing; never blocks.

        Returns:
            False if the batch was dropped because the tier is behind (back-pressure).
        """
        if not items:
            return True
        with self._lock:
            if self._pending_stores >= self._max_pending:
                self._stats["stores_dropped"] += len(items)
                return False
            self._pending_stores += 1
        self._pool.submit(self._store_io, list(items))
        return True

    def load(self, keys: Sequence[TierKey]) -> TierLoad:
        """Start reading ``keys``; poll the returned :class:`TierLoad`. Never blocks."""
        keys = tuple(keys)
        # Split over the I/O threads: reads and checksums release the GIL.
        n = max(1, -(-len(keys) // self._io_threads))
        parts = [keys[i:i + n] for i in range(0, len(keys), n)] or [()]
        return TierLoad(keys, [self._pool.submit(self._load_io, part) for part in parts])

    def load_into(self, keys: Sequence[TierKey], dests: Sequence[Sequence[memoryview]]) -> TierLoad:
        """Start reading ``keys`` straight into ``dests`` (per key, writable byte buffers
        its payload fills in order, e.g. the rows of a CPU slot). Never blocks.

        The :class:`TierLoad`'s values are True where the payload is in its buffers, None
        where it is missing, damaged or of another size (its buffers then hold garbage).
        """
        keys, dests = tuple(keys), tuple(dests)
        n = max(1, -(-len(keys) // self._io_threads))
        return TierLoad(keys, [self._pool.submit(self._load_into_io, keys[i:i + n], dests[i:i + n])
                               for i in range(0, len(keys), n)])

    def take_events(self) -> list[TierEvent]:
        """Stored / removed keys since the last call.

        A key is stored once, when this process first wrote it, and removed once, when
        this process learns that it went: the tier evicted or deleted it, or a load
        found it missing or damaged (another process deleted it, or Redis evicted it).
        """
        with self._lock:
            events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, int]:
        """Counters since creation, keyed ``<medium>_<name>`` (e.g. ``disk_stores_dropped``)."""
        prefix = self.medium.lower()
        with self._lock:
            return {f"{prefix}_{k}": v for k, v in self._stats.items()}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until no store is pending (tests, benchmarks, shutdown); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending_stores == 0, timeout)

    def close(self) -> None:
        """Finish queued I/O and release the backend (safe to call twice)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- I/O threads
    def _record_event(self, keys: Sequence[TierKey], removed: bool) -> None:
        """Record the keys that entered (or left) the tier; keys already announced (or
        never announced) are left out, so the stream matches the tier's contents."""
        if not self._enable_events or not keys:
            return
        with self._lock:
            held = self._announced
            if removed:
                keys = [k for k in keys if held.pop(k, 0) is None]
            else:
                keys = [k for k in dict.fromkeys(keys) if k not in held]
                held.update(dict.fromkeys(keys))
            if keys:
                self._events.append(TierEvent(tuple(keys), self.medium, removed))
            if self.max_announced is not None and len(held) > self.max_announced:
                # Forgotten keys leave the stream (a consumer treats tier events as hints).
                old = list(itertools.islice(held, len(held) - self.max_announced))
                for k in old:
                    del held[k]
                self._events.append(TierEvent(tuple(old), self.medium, True))

    def _log_failure(self, kind: str, what: str, exc: BaseException) -> None:
        """Log the first of a run of failed ``kind`` operations (later ones are counted,
        and logged at debug level, until one succeeds)."""
        with self._lock:
            first = kind not in self._failing
            self._failing.add(kind)
        if first:
            logger.warning("%s tier %s failed: %s (further %s failures are counted, not logged, "
                           "until one succeeds)", self.medium, what, exc, kind)
        else:
            logger.debug("%s tier %s failed: %s", self.medium, what, exc)

    def _succeeded(self, kind: str) -> None:
        if kind in self._failing:  # read without the lock: a stale answer only delays a log
            with self._lock:
                self._failing.discard(kind)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._stats[name] += delta

    def _lookup_io(self, keys: tuple[TierKey, ...]) -> list[bool]:
        try:
            held = self._held(keys)
        except Exception as exc:  # noqa: BLE001 - a failed lookup is a miss
            self._log_failure("lookup", f"lookup of {len(keys)} keys", exc)
            self._count(lookups=1, lookup_failures=1)
            return [False] * len(keys)
        self._succeeded("lookup")
        self._count(lookups=1)
        return held

    def _store_io(self, items: list[tuple[TierKey, bytes | memoryview]]) -> None:
        try:
            framed = [(key, (frame_header(key, payload), payload)) for key, payload in items]
            self._put(framed)
        except Exception as exc:  # noqa: BLE001 - a failed store is invisible, counted
            self._log_failure("store", f"store of {len(items)} values", exc)
            self._count(store_failures=len(items))
        else:
            self._succeeded("store")
            self._count(stores=len(items), bytes_stored=sum(len(p) for _, p in items))
            self._record_event([key for key, _ in items], removed=False)
        finally:
            with self._idle:
                self._pending_stores -= 1
                self._idle.notify_all()

    def _load_io(self, keys: tuple[TierKey, ...]) -> list[bytes | None]:
        try:
            raw = self._get(keys)
        except Exception as exc:  # noqa: BLE001 - a failed load is recomputed by the caller
            self._settle(keys, [FAILED] * len(keys), [], exc)
            return [None] * len(keys)
        values = [unframe_value(key, value) for key, value in zip(keys, raw, strict=True)]
        self._settle(keys, [PLACED if v is not None else ABSENT if r is None else DAMAGED
                            for v, r in zip(values, raw, strict=True)],
                     [len(v) if v is not None else 0 for v in values])
        return values

    def _load_into_io(self, keys: tuple[TierKey, ...], dests: tuple[Sequence[memoryview], ...]
                      ) -> list[bool | None]:
        try:
            status = self._get_into(keys, dests)
        except Exception as exc:  # noqa: BLE001 - a failed load is recomputed by the caller
            self._settle(keys, [FAILED] * len(keys), [], exc)
            return [None] * len(keys)
        self._settle(keys, status, [sum(d.nbytes for d in dest) for dest in dests])
        return [True if s == PLACED else None for s in status]

    def _settle(self, keys: Sequence[TierKey], status: Sequence[str], sizes: Sequence[int],
                error: Exception | None = None) -> None:
        """Count a read, drop its damaged values and record the keys that went."""
        if error is not None:
            self._log_failure("load", f"load of {len(keys)} values", error)
        else:
            self._succeeded("load")
        placed = [s == PLACED for s in status]
        self._count(loads=sum(placed), load_failures=len(keys) - sum(placed),
                    bytes_loaded=sum(n for n, p in zip(sizes, placed, strict=False) if p))
        bad = [k for k, s in zip(keys, status, strict=True) if s == DAMAGED]
        if bad:
            self._on_bad_values(bad)
        # A missing value went (evicted, or deleted by another process); a damaged one was
        # just deleted: either way the tier no longer holds it.
        self._record_event([k for k, s in zip(keys, status, strict=True) if s in (ABSENT, DAMAGED)],
                           removed=True)

    def _on_bad_values(self, keys: list[TierKey]) -> None:  # noqa: B027 - optional hook
        """Called with keys whose stored value was present but not intact (drop them)."""


def make_tiers(specs: Sequence[dict[str, Any]], *, layout: str, enable_events: bool,
               shard: Shard | None = None) -> list[SecondaryTier]:
    """Create the tiers of ``extra_config["tiers"]`` (validated by ``OffloadConfig``).

    A Redis tier without a ``layout`` gets ``layout`` (the connector's chunk geometry), so
    engines whose KV bytes differ never share keys. ``shard``: the worker's (see
    :class:`~connectors.offload.tiers.SecondaryTier`).

    Raises:
        ConfigError: a bad tier setting.
    """
    from connectors.offload.tiers import make_tier

    tiers: list[SecondaryTier] = []
    try:
        for spec in specs:
            if spec.get("type") == "redis":
                spec = {"layout": layout, **spec}
            tiers.append(make_tier(spec, enable_events=enable_events, shard=shard))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers
