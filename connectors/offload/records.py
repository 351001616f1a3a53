"""Records the two sides of the CPU offloading connector exchange.

Primitives: :class:`TransferJobSpec`, :class:`TierRead`, :class:`TierWrite`,
:class:`TierWriteJob`, :class:`OffloadingConnectorMetadata` (scheduler -> worker),
:class:`OffloadWorkerMetadata` (worker -> scheduler).
"""

from __future__ import annotations

import msgspec

from connectors.offload.manager import OffloadKey
from kvconnector_core.connector.metadata import KVConnectorMetadata
from kvconnector_core.kv_cache.hashing import BlockHash

__all__ = [
    "OffloadWorkerMetadata",
    "OffloadingConnectorMetadata",
    "TierRead",
    "TierWrite",
    "TierWriteJob",
    "TransferJobSpec",
]


class TierRead(msgspec.Struct, frozen=True, array_like=True):
    """Read one chunk from a secondary tier into CPU sub-blocks (promotion).

    Attributes:
        tier: index of the tier in ``extra_config["tiers"]``.
        key: the chunk key (chained hash of its last GPU block).
        cpu_block_ids: the CPU sub-blocks it fills, in order.
    """

    tier: int
    key: OffloadKey
    cpu_block_ids: list[int]


class TierWrite(msgspec.Struct, frozen=True, array_like=True):
    """Copy one chunk the CPU tier stored into every secondary tier (the cascade).

    Attributes:
        key: the chunk key.
        cpu_block_ids: the CPU sub-blocks holding it.
        block_hashes: hashes of its GPU blocks (for the tiers' stored events).
        parent_block_hash: hash of the GPU block before it, or None.
    """

    key: OffloadKey
    cpu_block_ids: list[int]
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None


class TierWriteJob(msgspec.Struct, frozen=True):
    """Chunks to cascade into the tiers; their CPU slots stay pinned until it is reported."""

    job_id: int
    writes: list[TierWrite]


class TransferJobSpec(msgspec.Struct, frozen=True):
    """One planned transfer (scheduler -> worker).

    Attributes:
        job_id: unique id, reported back on completion.
        req_id: the request the blocks belong to.
        gpu_block_ids: device block ids, pairwise with ``cpu_block_ids``.
        cpu_block_ids: CPU sub-block ids (chunk ``k`` = sub-blocks ``k*f .. k*f+f-1``).
        tier_reads: (loads) chunks to read from secondary tiers into their CPU sub-blocks
            before the CPU -> GPU copy: hits promoted through the CPU tier.
    """

    job_id: int
    req_id: str
    gpu_block_ids: list[int]
    cpu_block_ids: list[int]
    tier_reads: list[TierRead] = msgspec.field(default_factory=list)


class OffloadingConnectorMetadata(KVConnectorMetadata, kw_only=True):
    """The step's plan of the offloading connector.

    Attributes:
        loads: CPU -> GPU jobs to submit now.
        stores: GPU -> CPU jobs of blocks this step computes (submitted next step).
        preempted_req_ids: requests whose stores must be flushed before the forward.
        delayed_free_req_ids: finished requests whose blocks the scheduler keeps until
            they are reported in ``finished_sending``.
        tier_writes: stored chunks to copy into the secondary tiers (before the forward).
        flush_job_ids: stores in flight that read a block the engine allocated again this
            step (a sliding-window block that left the window): the worker waits for
            them before the forward can rewrite the block.
    """

    loads: list[TransferJobSpec] = msgspec.field(default_factory=list)
    stores: list[TransferJobSpec] = msgspec.field(default_factory=list)
    preempted_req_ids: list[str] = msgspec.field(default_factory=list)
    delayed_free_req_ids: list[str] = msgspec.field(default_factory=list)
    tier_writes: list[TierWriteJob] = msgspec.field(default_factory=list)
    flush_job_ids: list[int] = msgspec.field(default_factory=list)


class OffloadWorkerMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """Transfer jobs the worker finished since its last report (worker -> scheduler).

    With several workers (tensor parallelism) every worker moves its own shard of
    each job and reports it; :meth:`aggregate` folds the workers' reports into one
    and keeps one entry per report, so the scheduler side completes a job only
    once ``config.world_size`` reports have arrived (in any steps).

    Attributes:
        done_job_ids: jobs that completed successfully (one entry per worker report).
        failed_job_ids: jobs that failed (stores are dropped, loads recomputed).
    """

    done_job_ids: list[int] = msgspec.field(default_factory=list)
    failed_job_ids: list[int] = msgspec.field(default_factory=list)

    def aggregate(self, other: OffloadWorkerMetadata) -> OffloadWorkerMetadata:
        """Fold another worker's report of the same step into this one (reports add up)."""
        return OffloadWorkerMetadata(done_job_ids=self.done_job_ids + other.done_job_ids,
                                     failed_job_ids=self.failed_job_ids + other.failed_job_ids)
