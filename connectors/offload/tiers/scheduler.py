"""Scheduler half of the cascade of secondary tiers behind the CPU tier.

Data path: GPU <-> CPU tier <-> secondary tiers (``extra_config["tiers"]``, in order).
A tier never sees GPU memory:

- **Stores cascade** (write-through): once a chunk's GPU -> CPU store has succeeded, the
  scheduler side pins its CPU slot and plans a :class:`TierWrite`; the worker copies the
  slot's bytes out (a host memcpy) and hands them to every tier, then reports the job so
  the slot is unpinned. A tier that is behind drops the write and counts it.
- **Hits are promoted** through the CPU tier: the scheduler side asks the tiers for the
  chunks the CPU tier lacks, in every KV cache group (:class:`TierLookups`; "ask again"
  while a tier's I/O runs; per key, so that a sliding window after a gap is found),
  reserves CPU slots for them, and plans a load job with :class:`TierRead` s. The worker
  reads the values, copies them into the CPU slots, and only then submits the CPU -> GPU
  copy. If any value is missing or fails its checksum the whole job fails: its GPU blocks
  are recomputed and the reserved CPU slots are dropped, never made visible.

Keys: an offload key ends with its KV cache group (4 bytes, big-endian, as in vLLM 0.33);
:func:`tier_key` splits it into the tier's ``TierKey(block_hash, group, shard)``, so a tier
file or Redis key names the group, and under tensor / pipeline parallelism the worker's
shard: each worker writes and reads its own shard's keys, and the scheduler side counts a
chunk as held only when every worker's shard is (see :class:`TierLookups`).


Primitives: :class:`TierLookups`, :class:`SchedulerTiers` (the records ``TierRead``,
``TierWrite`` and ``TierWriteJob`` are in :mod:`connectors.offload.records`; the worker
half is :class:`~connectors.offload.tiers.worker.WorkerTiers`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from connectors.offload.manager import OffloadKey
from connectors.offload.records import TierRead, TierWrite, TierWriteJob
from connectors.offload.tiers.base import SecondaryTier
from connectors.offload.tiers.records import Shard, tier_key
from kvconnector_core.errors import InvariantError
from kvconnector_core.kv_cache.hashing import BlockHash

if TYPE_CHECKING:
    from connectors.offload.events import ChunkInfo
    from connectors.offload.manager import CPUOffloadingManager

__all__ = ["SchedulerTiers", "TierLookups"]


class TierLookups:
    """Scheduler side: which tier serves each chunk the CPU tier lacks, asked asynchronously.

    Every key is asked of tier 0, the keys tier 0 lacks of tier 1, and so on. The answer is
    per key (not a prefix): a sliding-window group needs the chunks of its last window,
    which may follow chunks no tier holds.

    Under tensor / pipeline parallelism every worker keeps its own shard of a chunk under
    its own key (``shards``): a tier holds the chunk only if it holds every shard, so no
    worker is sent to load a shard that is not there. All shards of all chunks go in one
    lookup (one pipeline of ``EXISTS`` on Redis).
    """

    def __init__(self, tiers: Sequence[SecondaryTier], shards: Sequence[Shard | None] = (None,)
                 ) -> None:
        self.tiers = list(tiers)
        self.shards = tuple(shards)
        # req id -> (keys asked, per tier its answer for the keys the tiers before it lack)
        self._asked: dict[str, tuple[tuple[OffloadKey, ...], list[list[bool]]]] = {}

    def sources(self, req_id: str, keys: Sequence[OffloadKey]) -> list[int | None] | None:
        """Per key, the index of the first tier that holds it (None: no tier does); None
        means ask again next step.

        The answer is kept until :meth:`forget` (or a call with other keys), so asking
        again is cheap.
        """
        keys = tuple(keys)
        asked = self._asked.get(req_id)
        if asked is None or asked[0] != keys:
            self.forget(req_id)
            asked = self._asked[req_id] = (keys, [])
        answers = asked[1]
        source: list[int | None] = [None] * len(keys)
        for t, tier in enumerate(self.tiers):
            todo = [i for i, s in enumerate(source) if s is None]
            if t < len(answers):
                held = answers[t]
            else:
                n = len(self.shards)
                got = tier.lookup_each([tier_key(keys[i], s) for i in todo for s in self.shards],
                                       token=(req_id, t)) if todo else []
                if got is None:
                    return None
                held = [all(got[j:j + n]) for j in range(0, len(got), n)]
                answers.append(held)
            for i, h in zip(todo, held, strict=True):
                if h:
                    source[i] = t
        return source

    def answered(self, req_id: str) -> dict[OffloadKey, int]:
        """The tier of each key held somewhere, from the request's complete answer (empty
        if it has none)."""
        asked = self._asked.get(req_id)
        if asked is None or len(asked[1]) < len(self.tiers):
            return {}
        found = self.sources(req_id, asked[0]) or []
        return {k: t for k, t in zip(asked[0], found, strict=True) if t is not None}

    def forget(self, req_id: str) -> None:
        """Drop the request's answers and any lookup still running for it."""
        asked = self._asked.pop(req_id, None)
        if asked is not None and len(asked[1]) < len(self.tiers):
            self.tiers[len(asked[1])].cancel_lookup((req_id, len(asked[1])))

    def close(self) -> None:
        """Close every tier."""
        for tier in self.tiers:
            tier.close()


class SchedulerTiers:
    """Scheduler side of the cascade over the CPU tier's manager: which chunks the tiers
    serve, CPU slots reserved for promotions, CPU slots pinned for write-through copies.

    Args:
        tiers: the tiers (this side only looks things up in them).
        manager: the CPU tier's slots.
        blocks_per_chunk: CPU sub-blocks per chunk (slot).
        shards: every worker's shard (``Shard.all_of``); a chunk is in a tier only if
            all of them are.
    """

    def __init__(self, tiers: Sequence[SecondaryTier], manager: CPUOffloadingManager,
                 blocks_per_chunk: int, shards: Sequence[Shard | None] = (None,)) -> None:
        self.lookups = TierLookups(tiers, shards)
        self.manager = manager
        self.f = blocks_per_chunk

    def _subs(self, slot: int) -> list[int]:
        return [slot * self.f + j for j in range(self.f)]

    def in_cpu(self, key: OffloadKey) -> bool:
        """True if the CPU tier holds ``key`` ready to load."""
        return self.manager.lookup((key,)) == 1

    def promotable(self, req_id: str, keys: Sequence[OffloadKey]) -> set[OffloadKey] | None:
        """The ``keys`` a tier serves and the CPU tier could take by promotion; None: ask
        again next step.

        A promotion needs a fresh CPU slot per chunk. A chunk the CPU tier already holds
        but that is not ready (its store, or another request's promotion, is still in
        flight) cannot get one and cannot be loaded yet, so it is no tier hit: it is
        recomputed, as a CPU-only lookup would do.
        """
        sources = self.lookups.sources(req_id, keys)
        if sources is None:
            return None
        policy = self.manager.policy
        return {k for k, t in zip(keys, sources, strict=True)
                if t is not None and policy.get(k) is None}

    def room(self, cpu_keys: int) -> int:
        """CPU slots promotions may take now, besides ``cpu_keys`` chunks a load will pin."""
        return self.manager.num_free_blocks + self.manager.num_evictable_blocks - cpu_keys

    def plan_promotion(self, req_id: str, wanted: Sequence[OffloadKey]) -> list[TierRead]:
        """Reserve CPU slots for the ``wanted`` chunks and say which tier serves each.

        The slots stay invisible to lookups until the load completes
        (``complete_store(promoted, success)``). The request's lookup answer is used up.

        Raises:
            InvariantError: the tiers' answer no longer covers the chunks, or the CPU tier
                cannot take them (the scheduler then recomputes the request).
        """
        found = self.lookups.answered(req_id)
        self.lookups.forget(req_id)
        wanted = list(wanted)
        if any(k not in found for k in wanted):
            msg = f"request {req_id}: {len(wanted)} chunks to promote are no longer all in a tier"
            raise InvariantError(msg)
        out = self.manager.prepare_store(wanted)
        if out is None or list(out.keys_to_store) != wanted:
            if out is not None:
                self.manager.complete_store(out.keys_to_store, success=False)
            msg = (f"request {req_id}: the CPU tier cannot take {len(wanted)} chunks promoted "
                   "from a tier")
            raise InvariantError(msg)
        return [TierRead(found[key], key, self._subs(slot))
                for key, slot in zip(wanted, out.store_spec.block_ids, strict=True)]

    def plan_writes(self, job_id: int, keys: Sequence[OffloadKey],
                    info_of: Callable[[OffloadKey], ChunkInfo | None]
                    ) -> tuple[TierWriteJob, tuple[OffloadKey, ...]] | None:
        """Pin the chunks the CPU tier just stored and describe their copy into the tiers.

        ``info_of`` gives each chunk's GPU block hashes for the tiers' events (None, and
        the key alone stands for them, where it has none, i.e. with events off). Returns
        the job and the pinned keys (unpin them with ``complete_load`` once the job is
        reported).
        """
        keys = tuple(k for k in keys if self.in_cpu(k))
        if not keys:
            return None
        spec = self.manager.prepare_load(keys)
        writes = []
        for key, slot in zip(keys, spec.block_ids, strict=True):
            info = info_of(key)
            hashes, parent = ((info.block_hashes, info.parent_block_hash) if info
                              else ((BlockHash(key[:-4]),), None))
            writes.append(TierWrite(key, self._subs(slot), list(hashes), parent))
        return TierWriteJob(job_id, writes), keys

    def close(self) -> None:
        """Close the tiers."""
        self.lookups.close()
