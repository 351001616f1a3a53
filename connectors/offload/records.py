"""Records the two sides of the CPU offloading connector exchange.

Primitives: :class:`TransferJobSpec`, :class:`OffloadingConnectorMetadata` (scheduler ->
worker), :class:`OffloadWorkerMetadata` (worker -> scheduler).
"""

from __future__ import annotations

import msgspec

from kvconnector_core.connector.metadata import KVConnectorMetadata

__all__ = ["OffloadWorkerMetadata", "OffloadingConnectorMetadata", "TransferJobSpec"]


class TransferJobSpec(msgspec.Struct, frozen=True):
    """One planned transfer (scheduler -> worker).

    Attributes:
        job_id: unique id, reported back on completion.
        req_id: the request the blocks belong to.
        gpu_block_ids: device block ids, pairwise with ``cpu_block_ids``.
        cpu_block_ids: CPU sub-block ids (chunk ``k`` = sub-blocks ``k*f .. k*f+f-1``).
    """

    job_id: int
    req_id: str
    gpu_block_ids: list[int]
    cpu_block_ids: list[int]


class OffloadingConnectorMetadata(KVConnectorMetadata, kw_only=True):
    """The step's plan of the offloading connector.

    Attributes:
        loads: CPU -> GPU jobs to submit now.
        stores: GPU -> CPU jobs of blocks this step computes (submitted next step).
        preempted_req_ids: requests whose stores must be flushed before the forward.
        delayed_free_req_ids: finished requests whose blocks the scheduler keeps until
            they are reported in ``finished_sending``.
    """

    loads: list[TransferJobSpec] = msgspec.field(default_factory=list)
    stores: list[TransferJobSpec] = msgspec.field(default_factory=list)
    preempted_req_ids: list[str] = msgspec.field(default_factory=list)
    delayed_free_req_ids: list[str] = msgspec.field(default_factory=list)


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
