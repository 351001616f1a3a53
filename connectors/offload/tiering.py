"""Secondary tiers behind the CPU tier: the offload connector's two halves of the cascade.

Data path: GPU <-> CPU tier <-> secondary tiers (``extra_config["tiers"]``, in order).
A tier never sees GPU memory:

- **Stores cascade** (write-through): once a chunk's GPU -> CPU store has succeeded, the
  scheduler side pins its CPU slot and plans a :class:`TierWrite`; the worker copies the
  slot's bytes out (a host memcpy) and hands them to every tier, then reports the job so
  the slot is unpinned. A tier that is behind drops the write and counts it.
- **Hits are promoted** through the CPU tier: the scheduler side asks the tiers for the
  chunks after the CPU hit (:class:`TierLookups`; "ask again" while a tier's I/O runs),
  reserves CPU slots for them, and plans a load job with :class:`TierRead` s. The worker
  reads the values, copies them into the CPU slots, and only then submits the CPU -> GPU
  copy. If any value is missing or fails its checksum the whole job fails: its GPU blocks
  are recomputed and the reserved CPU slots are dropped, never made visible.

Keys: an offload key ends with its KV cache group (4 bytes, big-endian, as in vLLM 0.33);
:func:`tier_key` splits it into the tier's ``TierKey(block_hash, group)``, so a tier file or
Redis key names the group.

Primitives: TierLookups, SchedulerTiers, WorkerTiers, make_tiers, tier_key (the records TierRead,
TierWrite and TierWriteJob are in :mod:`connectors.offload.records`).
"""

from __future__ import annotations

import collections
import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connectors.offload.policies import OffloadKey
from connectors.offload.records import TierRead, TierWrite, TierWriteJob
from connectors.tiers import SecondaryTier, TierKey, make_tier
from kvconnector_core.errors import InvariantError
from kvconnector_core.kv_cache.hashing import BlockHash
from kvconnector_core.kv_events import (
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
    to_external_hash,
)

if TYPE_CHECKING:
    import torch

    from connectors.offload.events import ChunkInfoTable
    from connectors.offload.manager import CPUOffloadingManager
    from connectors.tiers import TierLoad

__all__ = ["SchedulerTiers", "TierLookups", "WorkerTiers", "make_tiers", "tier_key"]

logger = logging.getLogger(__name__)

# Chunk descriptions kept for the tier events of keys this worker wrote; a bound, because
# Redis evicts silently and would otherwise never let go of them.
_MAX_DESCRIBED = 100_000


def make_tiers(specs: Sequence[dict[str, Any]], *, layout: str, enable_events: bool
               ) -> list[SecondaryTier]:
    """Create the tiers of ``extra_config["tiers"]`` (validated by ``OffloadConfig``).

    A Redis tier without a ``layout`` gets ``layout`` (the connector's chunk geometry), so
    engines whose KV bytes differ never share keys.

    Raises:
        ConfigError: a bad tier setting.
    """
    tiers: list[SecondaryTier] = []
    try:
        for spec in specs:
            if spec.get("type") == "redis":
                spec = {"layout": layout, **spec}
            tiers.append(make_tier(spec, enable_events=enable_events))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def tier_key(key: OffloadKey) -> TierKey:
    """The tier key of an offload key: its chained hash and its KV cache group (the key's
    last 4 bytes)."""
    return TierKey(BlockHash(key[:-4]), int.from_bytes(key[-4:], "big"))


def _offload_key(key: TierKey) -> OffloadKey:
    return OffloadKey(key.block_hash + key.group.to_bytes(4, "big"))


class TierLookups:
    """Scheduler side: which chunks after the CPU hit each tier serves, asked asynchronously."""

    def __init__(self, tiers: Sequence[SecondaryTier]) -> None:
        self.tiers = list(tiers)
        # req id -> (index of the first key asked, answers so far: keys served per tier)
        self._asked: dict[str, tuple[int, list[int]]] = {}

    def lookup(self, req_id: str, keys: Sequence[OffloadKey], first: int) -> list[int] | None:
        """Per tier, how many chunks it serves, each tier continuing where the one before
        stopped, for ``keys[first:]``; None means ask again next step.

        The answer is kept until :meth:`forget`, so asking again is cheap.
        """
        if not self.tiers or first >= len(keys):
            return [0] * len(self.tiers)
        asked = self._asked.get(req_id)
        if asked is None or asked[0] != first:
            if asked is not None:
                self.forget(req_id)
            asked = self._asked[req_id] = (first, [])
        answers = asked[1]
        pos = first + sum(answers)
        while len(answers) < len(self.tiers):
            tier = self.tiers[len(answers)]
            held = tier.lookup([tier_key(k) for k in keys[pos:]], token=(req_id, pos))
            if held is None:
                return None
            answers.append(held)
            pos += held
        return list(answers)

    def forget(self, req_id: str) -> None:
        """Drop the request's answers and any lookup still running for it."""
        asked = self._asked.pop(req_id, None)
        if asked is None:
            return
        pos = asked[0] + sum(asked[1])
        if len(asked[1]) < len(self.tiers):
            self.tiers[len(asked[1])].cancel_lookup((req_id, pos))

    def close(self) -> None:
        """Close every tier."""
        for tier in self.tiers:
            tier.close()


class SchedulerTiers:
    """Scheduler side of the cascade over the CPU tier's manager: extra hits from the tiers,
    CPU slots reserved for promotions, CPU slots pinned for write-through copies.

    Args:
        tiers: the tiers (this side only looks things up in them).
        manager: the CPU tier's slots.
        blocks_per_chunk: GPU blocks per chunk (CPU sub-blocks per slot).
    """

    def __init__(self, tiers: Sequence[SecondaryTier], manager: CPUOffloadingManager,
                 blocks_per_chunk: int) -> None:
        self.lookups = TierLookups(tiers)
        self.manager = manager
        self.f = blocks_per_chunk

    def _subs(self, slot: int) -> list[int]:
        return [slot * self.f + j for j in range(self.f)]

    def extra_hits(self, req_id: str, keys: Sequence[OffloadKey], first: int, cpu_hits: int) -> int | None:
        """Chunks from ``keys[first]`` on that the tiers serve and the CPU tier has room to
        promote now (besides the request's ``cpu_hits`` chunks, which its load pins);
        None: ask again next step."""
        answers = self.lookups.lookup(req_id, keys, first)
        if answers is None:
            return None
        room = self.manager.num_free_blocks + self.manager.num_evictable_blocks - cpu_hits
        return max(0, min(sum(answers), room))

    def plan_promotion(self, req_id: str, keys: Sequence[OffloadKey], first: int, end: int
                       ) -> tuple[list[OffloadKey], list[TierRead]]:
        """Reserve CPU slots for chunks ``first .. end-1`` and say which tier serves each.

        The slots stay invisible to lookups until the load completes
        (``complete_store(promoted, success)``). The request's lookup answer is used up.

        Raises:
            InvariantError: the tiers' answer no longer covers the chunks, or the CPU tier
                cannot take them (the scheduler then recomputes the request).
        """
        answers = self.lookups.lookup(req_id, keys, first)
        self.lookups.forget(req_id)
        tier_of = [t for t, n in enumerate(answers or ()) for _ in range(n)]
        wanted = list(keys[first:end])
        if len(tier_of) < len(wanted):
            msg = f"request {req_id}: chunks {first}..{end - 1} are no longer in the CPU tier or a tier"
            raise InvariantError(msg)
        out = self.manager.prepare_store(wanted)
        if out is None or list(out.keys_to_store) != wanted:
            if out is not None:
                self.manager.complete_store(out.keys_to_store, success=False)
            msg = f"request {req_id}: the CPU tier cannot take {len(wanted)} chunks promoted from a tier"
            raise InvariantError(msg)
        reads = [TierRead(tier_of[i], key, self._subs(slot))
                 for i, (key, slot) in enumerate(zip(wanted, out.store_spec.block_ids, strict=True))]
        return wanted, reads

    def plan_writes(self, job_id: int, keys: Sequence[OffloadKey], chunk_info: ChunkInfoTable
                    ) -> tuple[TierWriteJob, tuple[OffloadKey, ...]] | None:
        """Pin the chunks the CPU tier just stored and describe their copy into the tiers.

        ``chunk_info`` gives each chunk's GPU block hashes for the tiers' events (the key
        alone where it has none, i.e. with events off). Returns the job and the pinned
        keys (unpin them with ``complete_load`` once the job is reported).
        """
        keys = tuple(keys[:self.manager.lookup(keys)])
        if not keys:
            return None
        spec = self.manager.prepare_load(keys)
        writes = []
        for key, slot in zip(keys, spec.block_ids, strict=True):
            info = chunk_info.get(key)
            # Without its info (events off) a chunk is described by its own block hash.
            hashes, parent = ((info.block_hashes, info.parent_block_hash) if info
                              else ((tier_key(key).block_hash,), None))
            writes.append(TierWrite(key, self._subs(slot), list(hashes), parent))
        return TierWriteJob(job_id, writes), keys

    def close(self) -> None:
        """Close the tiers."""
        self.lookups.close()


@dataclass(slots=True)
class _ReadJob:
    reads: list[TierRead]
    loads: list[TierLoad]


class WorkerTiers:
    """Worker side: copies chunks between the CPU buffer and the tiers; never blocks a step."""

    def __init__(self, tiers: Sequence[SecondaryTier], *, block_size: int = 0) -> None:
        self.tiers = list(tiers)
        self.block_size = block_size
        self._planes: tuple[torch.Tensor, ...] = ()
        self._jobs: dict[int, _ReadJob] = {}
        self._described: collections.OrderedDict[OffloadKey, tuple[list[BlockHash], BlockHash | None]] = (
            collections.OrderedDict())
        self.writes_dropped = 0
        self._reported: dict[str, int] = {}

    def bind_buffer(self, cpu_planes: Sequence[torch.Tensor]) -> None:
        """Use the CPU tier's buffer: uint8 planes of shape (sub-blocks, bytes per sub-block)."""
        self._planes = tuple(cpu_planes)

    # ------------------------------------------------------------ CPU buffer <-> bytes
    def _rows(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """(address, bytes) of each run of the chunk's rows in every plane, in order."""
        runs = []
        for plane in self._planes:
            row = plane.stride(0)
            start = prev = ids[0]
            for i in [*ids[1:], None]:
                if i is not None and i == prev + 1:
                    prev = i
                    continue
                runs.append((plane.data_ptr() + start * row, (prev - start + 1) * row))
                if i is not None:
                    start = prev = i
        return runs

    def _read_cpu(self, ids: Sequence[int]) -> bytes:
        return b"".join(ctypes.string_at(addr, n) for addr, n in self._rows(ids))

    def _write_cpu(self, ids: Sequence[int], value: bytes) -> bool:
        runs = self._rows(ids)
        if sum(n for _, n in runs) != len(value):
            return False  # a value of another geometry: a failed load, never a partial copy
        offset = 0
        for addr, n in runs:
            ctypes.memmove(addr, value[offset:offset + n], n)
            offset += n
        return True

    # ------------------------------------------------------------ cascade and promotion
    def write(self, writes: Sequence[TierWrite]) -> None:
        """Copy the chunks out of the CPU buffer and queue them on every tier (non-blocking)."""
        if not writes or not self.tiers:
            return
        items = [(tier_key(w.key), self._read_cpu(w.cpu_block_ids)) for w in writes]
        for w in writes:
            self._described[w.key] = (w.block_hashes, w.parent_block_hash)
            self._described.move_to_end(w.key)
        while len(self._described) > _MAX_DESCRIBED:
            self._described.popitem(last=False)
        for tier in self.tiers:
            if not tier.store(items):
                self.writes_dropped += len(items)

    def start_reads(self, job_id: int, reads: Sequence[TierRead]) -> None:
        """Start reading a load job's chunks from their tiers (non-blocking)."""
        by_tier: dict[int, list[TierRead]] = {}
        for r in reads:
            by_tier.setdefault(r.tier, []).append(r)
        ordered = [r for t in sorted(by_tier) for r in by_tier[t]]
        loads = [self.tiers[t].load([tier_key(r.key) for r in rs])
                 for t, rs in sorted(by_tier.items())]
        self._jobs[job_id] = _ReadJob(ordered, loads)

    @property
    def pending_job_ids(self) -> list[int]:
        """Load jobs whose tier reads are still running."""
        return list(self._jobs)

    def finished_reads(self) -> list[tuple[int, bool]]:
        """Jobs whose reads all finished, as (job id, every chunk is in the CPU buffer)."""
        done = []
        for job_id, job in list(self._jobs.items()):
            if not all(load.done() for load in job.loads):
                continue
            del self._jobs[job_id]
            values = [v for load in job.loads for v in load.values()]
            ok = all(v is not None and self._write_cpu(r.cpu_block_ids, v)
                     for r, v in zip(job.reads, values, strict=True))
            done.append((job_id, ok))
        return done

    def wait_reads(self, timeout: float | None = None) -> None:
        """Block until every running read finished (shutdown, tests)."""
        for job in self._jobs.values():
            for load in job.loads:
                load.values(timeout)

    # ------------------------------------------------------------ events, stats
    def take_events(self) -> list[KVCacheEvent]:
        """The tiers' stored / removed chunks as wire events (medium ``DISK``, ``REDIS``...)."""
        out: list[KVCacheEvent] = []
        for tier in self.tiers:
            for event in tier.take_events():
                for key in event.keys:
                    hashes, parent = self._described.get(_offload_key(key), ([key.block_hash], None))
                    wire: list[ExternalBlockHash] = [to_external_hash(h) for h in hashes]
                    if event.removed:
                        out.append(BlockRemoved(block_hashes=wire, medium=event.medium,
                                                group_idx=key.group))
                    else:
                        out.append(BlockStored(
                            block_hashes=wire,
                            parent_block_hash=None if parent is None else to_external_hash(parent),
                            token_ids=[], block_size=self.block_size, lora_id=None,
                            medium=event.medium, lora_name=None, group_idx=key.group))
        return out

    def stats(self) -> dict[str, int]:
        """Every tier's counters (``disk_stores``, ``redis_load_failures``, ...) since the
        last call: connector stats are per-step deltas that the engine sums."""
        now: dict[str, int] = {}
        for tier in self.tiers:
            now.update(tier.stats())
        now["tier_writes_dropped"] = self.writes_dropped
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        return {k: v for k, v in delta.items() if v}

    def close(self) -> None:
        """Finish the tiers' queued I/O and close them."""
        for tier in self.tiers:
            tier.close()
