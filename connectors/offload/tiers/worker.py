"""Worker half of the cascade of secondary tiers behind the CPU tier.

The worker copies the CPU slots of write-through stores out into every tier, and reads
promoted chunks from their tiers into the CPU slots the scheduler side reserved (see
:mod:`connectors.offload.tiers.scheduler` for the cascade).

Primitives: :class:`WorkerTiers`.
"""

from __future__ import annotations

import collections
import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from connectors.offload.events import ChunkInfo, ChunkInfoTable, to_wire_events
from connectors.offload.manager import OffloadingEvent, OffloadKey
from connectors.offload.tiers.base import SecondaryTier
from connectors.offload.tiers.records import Shard, offload_key, tier_key
from kvconnector_core.kv_cache.hashing import BlockHash

if TYPE_CHECKING:
    import torch

    from connectors.offload.records import TierRead, TierWrite
    from connectors.offload.tiers.records import TierLoad
    from kvconnector_core.kv_events import KVCacheEvent

__all__ = ["WorkerTiers"]

logger = logging.getLogger(__name__)

# Chunk descriptions kept for the tier events of keys this worker wrote; a bound, because
# Redis evicts silently and would otherwise never let go of them.
_MAX_DESCRIBED = 100_000


@dataclass(slots=True)
class _ReadJob:
    reads: list[TierRead]
    loads: list[TierLoad]


class WorkerTiers:
    """Worker side: copies chunks between the CPU buffer and the tiers; never blocks a step.

    Args:
        tiers: the tiers.
        block_sizes: per KV cache group, tokens per GPU block (for events).
        shard: this worker's shard of every block (None: the engine's only worker); it
            writes and reads only keys of that shard.
    """

    def __init__(self, tiers: Sequence[SecondaryTier], *, block_sizes: Sequence[int] = (0,),
                 shard: Shard | None = None) -> None:
        self.tiers = list(tiers)
        self.shard = shard
        self.block_sizes = list(block_sizes)
        """Per KV cache group, tokens per GPU block (the block size of its events)."""
        # Per tier and group: the chunks the tier announced, reference counted per GPU
        # block hash like the CPU tier's events (chunks may share leading blocks).
        self._tables: dict[tuple[int, int], ChunkInfoTable] = {}
        self._planes: tuple[torch.Tensor, ...] = ()
        self._jobs: dict[int, _ReadJob] = {}
        self._described: collections.OrderedDict[
            OffloadKey, tuple[list[BlockHash], BlockHash | None]] = collections.OrderedDict()
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

    def _cpu_views(self, ids: Sequence[int]) -> list[memoryview]:
        """Writable views of the chunk's rows, in the order :meth:`_read_cpu` joins them:
        a tier reads a value straight into them (no intermediate bytes)."""
        return [memoryview((ctypes.c_char * n).from_address(addr)).cast("B")
                for addr, n in self._rows(ids)]

    # ------------------------------------------------------------ cascade and promotion
    def write(self, writes: Sequence[TierWrite]) -> None:
        """Copy the chunks out of the CPU buffer and queue them on every tier (non-blocking)."""
        if not writes or not self.tiers:
            return
        items = [(tier_key(w.key, self.shard), self._read_cpu(w.cpu_block_ids)) for w in writes]
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
        loads = [self.tiers[t].load_into([tier_key(r.key, self.shard) for r in rs],
                                         [self._cpu_views(r.cpu_block_ids) for r in rs])
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
            # Each value is in its CPU slot, or the load fails (the slots stay invisible).
            done.append((job_id, all(v for load in job.loads for v in load.values())))
        return done

    def wait_reads(self, timeout: float | None = None) -> None:
        """Block until every running read finished (shutdown, tests)."""
        for job in self._jobs.values():
            for load in job.loads:
                load.values(timeout)

    # ------------------------------------------------------------ events, stats
    def take_events(self) -> list[KVCacheEvent]:
        """The tiers' stored / removed chunks as wire events (medium ``DISK``, ``REDIS``...).

        Per tier and KV cache group, GPU block hashes are reference counted across the
        chunks the tier holds (as the CPU tier's events are): a hash is stored when the
        first chunk holding it enters the tier and removed when the last one leaves, so
        a replica of each medium holds exactly the blocks of the tier's chunks.
        """
        out: list[KVCacheEvent] = []
        for t, tier in enumerate(self.tiers):
            for event in tier.take_events():
                by_group: dict[int, list[OffloadKey]] = {}
                for key in event.keys:
                    by_group.setdefault(key.group, []).append(offload_key(key))
                for g, keys in by_group.items():
                    table = self._tables.setdefault((t, g), ChunkInfoTable())
                    if not event.removed:
                        for okey in keys:
                            described = self._described.get(okey)
                            if described is not None:
                                table.add(okey, ChunkInfo(tuple(described[0]), described[1], None))
                    block_size = self.block_sizes[g] if g < len(self.block_sizes) else 0
                    offloaded = OffloadingEvent(tuple(keys), event.medium, event.removed)
                    out += to_wire_events([offloaded], table, block_size, group_idx=g)
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
