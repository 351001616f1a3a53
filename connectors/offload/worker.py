"""Worker side of the CPU offloading connector.

One :class:`~connectors.offload.transfer.KVBlockMover` (one pinned CPU buffer allocated
in ``register_kv_caches``). Stores planned in step N are submitted at the start of step
N+1 (``bind_connector_metadata``, before the forward) so they never delay step N; loads
are submitted in ``start_load_kv`` and are asynchronous. Preempted requests' stores are
waited for in ``handle_preemptions`` before their blocks can be overwritten, and so are
the stores that read a sliding-window block the engine allocated again
(``flush_job_ids``, in ``bind_connector_metadata``: see :mod:`connectors.offload.fence`). Job
completions travel to the scheduler side as :class:`OffloadWorkerMetadata`.

With secondary tiers (:class:`~connectors.offload.tiers.worker.WorkerTiers`): a load with
``tier_reads`` first reads those chunks from their tiers into the CPU slots (off the
engine thread) and submits its CPU -> GPU copy only when all arrived; a missing or
damaged chunk fails the load (recomputed). ``tier_writes`` are copied out of the CPU
buffer into every tier when the plan is bound, and reported done at once.

Primitives: :class:`OffloadWorkerSide`.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connectors.offload.records import (
    OffloadingConnectorMetadata,
    OffloadWorkerMetadata,
    TransferJobSpec,
)
from connectors.offload.tiers.base import make_tiers
from connectors.offload.tiers.worker import WorkerTiers
from kvconnector_core.connector.base import KVConnectorWorkerSide
from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorTransferResults
from kvconnector_core.errors import ConfigError, InvariantError

if TYPE_CHECKING:
    import torch

    from connectors.offload.config import OffloadConfig
    from connectors.offload.tiers import Shard
    from connectors.offload.transfer import KVBlockMover, TransferResult
    from kvconnector_core.kv_events import KVCacheEvent

__all__ = ["OffloadWorkerSide"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _WorkerJob:
    spec: TransferJobSpec
    is_store: bool



class OffloadWorkerSide(KVConnectorWorkerSide):
    """Worker side of the CPU offloading connector (see the module docstring).

    Args:
        offload_config: the validated ``extra_config``.
        shard: this worker's shard of every block under tensor / pipeline parallelism
            (None: the engine's only worker); its tier keys name it.
    """

    def __init__(self, offload_config: OffloadConfig, shard: Shard | None = None) -> None:
        self.offload_config = offload_config
        self.mover: KVBlockMover | None = None
        self._worker_jobs: dict[int, _WorkerJob] = {}
        self._unsubmitted: list[TransferJobSpec] = []  # stores of the previous step
        self._req_jobs: dict[str, set[int]] = {}  # store jobs per request (both states)
        self._awaiting_send: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._stats: dict[str, Any] = {}
        # Completions popped from the mover but not yet reported: kept on the instance
        # so an exception halfway through a poll loses none of them.
        self._results: collections.deque[TransferResult] = collections.deque()
        self._done_jobs: list[int] = []
        self._failed_jobs: list[int] = []
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        cfg = offload_config
        block_sizes = [g.block_size for g in cfg.groups] or [cfg.gpu_block_size]
        self.tiers = WorkerTiers(make_tiers(cfg.tiers, layout=cfg.layout,
                                            enable_events=cfg.enable_events, shard=shard),
                                 block_sizes=block_sizes, shard=shard) if cfg.tiers else None
        self._tier_waiting: dict[int, TransferJobSpec] = {}  # loads waiting for tier reads

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Allocate the (pinned on CUDA) CPU buffer next to the KV cache.

        Raises:
            ConfigError: the layers live in tensors of different block counts or devices.
        """
        from connectors.offload.transfer import KVBlockMover

        cfg = self.offload_config
        try:
            # copy_thread on a CPU cache: the mover's thread makes the (synchronous) copies
            # off the engine thread (copy_ releases the GIL); a job is complete only once
            # get_finished / wait saw it copied, so loads land before they are reported.
            self.mover = KVBlockMover(kv_caches, cfg.num_cpu_blocks * cfg.sub_blocks_per_chunk,
                                      method=cfg.transfer_method, issue_thread=cfg.copy_thread)
        except ValueError as exc:
            msg = f"OffloadingConnector cannot use this KV cache: {exc}"
            raise ConfigError(msg) from exc
        if self.tiers is not None:
            self.tiers.bind_buffer(self.mover.cpu_planes)

    def _mover(self) -> KVBlockMover:
        if self.mover is None:
            msg = "OffloadingConnector: register_kv_caches() was not called"
            raise InvariantError(msg)
        return self.mover

    def _submit(self, job: TransferJobSpec, is_store: bool) -> None:
        self._worker_jobs[job.job_id] = _WorkerJob(job, is_store)
        if is_store:
            self._mover().submit_store(job.job_id, job.gpu_block_ids, job.cpu_block_ids)
        else:
            self._mover().submit_load(job.job_id, job.cpu_block_ids, job.gpu_block_ids)

    def _submit_stores(self, req_ids: set[str] | None = None) -> None:
        keep = []
        for job in self._unsubmitted:
            if req_ids is None or job.req_id in req_ids:
                self._submit(job, is_store=True)
            else:
                keep.append(job)
        self._unsubmitted = keep

    def _meta(self) -> OffloadingConnectorMetadata:
        # No plan bound (the scheduler side failed to build one): an empty step.
        meta = self.plan
        if not isinstance(meta, OffloadingConnectorMetadata):
            return OffloadingConnectorMetadata()
        return meta

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the plan and submit the previous step's stores, before this step's forward;
        wait for the stores reading blocks this step reuses (vLLM and kvconnector both
        bind before the forward and before any load is started)."""
        super().bind_connector_metadata(connector_metadata)
        if self.mover is not None:
            if self._unsubmitted:
                self._submit_stores()
            meta = self._meta()
            if meta.tier_writes:
                self._write_tiers()
            if meta.flush_job_ids:
                self.mover.wait(meta.flush_job_ids)
                self._add_stat("stores_fenced", len(meta.flush_job_ids))

    def _write_tiers(self) -> None:
        """Copy the pinned chunks into the tiers (non-blocking) and report the jobs done.

        A copy that fails is a failed tier store: never visible, and the CPU tier keeps
        the chunk either way, so the job is reported done (its slots get unpinned).
        """
        for job in self._meta().tier_writes:
            if self.tiers is not None:
                try:
                    self.tiers.write(job.writes)
                except Exception:  # contained: a failed store, logged
                    logger.exception("copying %d chunks into the tiers failed", len(job.writes))
            self._done_jobs.append(job.job_id)

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:
        """Finish preempted requests' stores before their blocks can be rewritten."""
        if not isinstance(connector_metadata, OffloadingConnectorMetadata):
            return
        preempted = set(connector_metadata.preempted_req_ids)
        if not preempted:
            return
        self._submit_stores(preempted)
        jobs = [j for r in preempted for j in self._req_jobs.get(r, ())]
        self._mover().wait(jobs)

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Submit this step's loads (async); stores were submitted when the plan was bound."""
        if self._unsubmitted:  # only if bind_connector_metadata could not submit them
            self._submit_stores()
        for job in self._meta().loads:
            if job.tier_reads and self.tiers is not None:
                # Promotion: tier values go into the CPU slots first; the CPU -> GPU copy
                # is submitted once all of them are there (see _poll).
                self._worker_jobs[job.job_id] = _WorkerJob(job, is_store=False)
                self._tier_waiting[job.job_id] = job
                self.tiers.start_reads(job.job_id, job.tier_reads)
            else:
                self._submit(job, is_store=False)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads complete before their request is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None
                      ) -> None:
        """Nothing per layer: whole blocks of all layers move once per step."""

    def wait_for_save(self) -> None:
        """Queue this step's stores; they are submitted at the start of the next step."""
        meta = self._meta()
        if meta.stores:
            for job in meta.stores:
                self._req_jobs.setdefault(job.req_id, set()).add(job.job_id)
            self._unsubmitted += meta.stores
        if meta.delayed_free_req_ids:
            self._awaiting_send.update(meta.delayed_free_req_ids)

    def _poll(self) -> KVConnectorTransferResults:
        if self._awaiting_send and self._unsubmitted:
            # A finished request waits on these stores: no later step is coming to
            # submit them for free, so submit now (after this step's forward).
            self._submit_stores(self._awaiting_send)
        if self.tiers is not None:
            from connectors.offload.transfer import TransferResult

            for job_id, ok in self.tiers.finished_reads():
                job = self._tier_waiting.pop(job_id)
                if ok:
                    self._submit(job, is_store=False)
                else:  # a chunk was missing or damaged: the whole load fails, recomputed
                    self._results.append(TransferResult(job_id, False, False, 0, None))
        if self.mover is not None:
            self._results.extend(self.mover.get_finished())
        while self._results:
            self._record(self._results.popleft())
        out = KVConnectorTransferResults(finished_recving=self._recv_done,
                                         failed_recving=self._recv_failed)
        self._recv_done, self._recv_failed = set(), set()
        if self._awaiting_send:
            for rid in list(self._awaiting_send):
                if not self._req_jobs.get(rid):
                    self._awaiting_send.discard(rid)
                    self._req_jobs.pop(rid, None)
                    out.finished_sending.add(rid)
        return out

    def _record(self, result: TransferResult) -> None:
        """Book one finished job (pending report state lives on the instance)."""
        job = self._worker_jobs.pop(result.job_id, None)
        if job is None:
            return
        (self._done_jobs if result.success else self._failed_jobs).append(result.job_id)
        if job.is_store:
            jobs = self._req_jobs.get(job.spec.req_id)
            if jobs is not None:
                jobs.discard(result.job_id)
                if not jobs and job.spec.req_id not in self._awaiting_send:
                    del self._req_jobs[job.spec.req_id]
        else:
            self._recv_done.add(job.spec.req_id)
            if not result.success:
                self._recv_failed.add(job.spec.req_id)
                self._invalid_block_ids.update(job.spec.gpu_block_ids)
        if result.success:
            bytes_key, seconds_key = (("bytes_stored", "store_seconds") if job.is_store
                                      else ("bytes_loaded", "load_seconds"))
            self._add_stat(bytes_key, result.num_bytes)
            self._add_stat(seconds_key, result.seconds or 0.0)

    def _add_stat(self, key: str, value: float) -> None:
        self._stats[key] = self._stats.get(key, 0) + value

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished stores (per delayed-free request) and loads, failed loads included."""
        return self._poll()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks of loads that failed since the last call."""
        ids, self._invalid_block_ids = self._invalid_block_ids, set()
        return ids

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Bytes and seconds moved since the last call (None when nothing moved), the
        stores waited for before a reused block was rewritten (``stores_fenced``), plus
        the tiers' counters (``disk_loads``, ``redis_stores_dropped``, ...)."""
        if not self._stats and self.tiers is None:
            return None  # most steps: nothing moved
        stats, self._stats = self._stats, {}
        if self.tiers is not None:
            stats.update(self.tiers.stats())
        return stats if any(stats.values()) else None

    def get_kv_connector_kv_cache_events(self) -> list[KVCacheEvent]:
        """What the secondary tiers stored and removed (medium ``DISK``, ``REDIS``)."""
        return self.tiers.take_events() if self.tiers is not None else []

    def build_connector_worker_meta(self) -> OffloadWorkerMetadata | None:
        """The jobs finished since the last call, for the scheduler side (None if none)."""
        if not (self._done_jobs or self._failed_jobs):
            return None
        meta = OffloadWorkerMetadata(done_job_ids=self._done_jobs, failed_job_ids=self._failed_jobs)
        self._done_jobs, self._failed_jobs = [], []
        return meta

    def has_pending_work(self) -> bool:
        """Stores not submitted yet (they go out a step late), jobs in flight, or results
        not reported to the scheduler side yet."""
        return bool(self._unsubmitted or self._worker_jobs or self._tier_waiting or self._results
                    or self._done_jobs or self._failed_jobs)

    def shutdown(self) -> None:
        """Wait for in-flight transfers (safe to call twice)."""
        if self.mover is not None:
            self._submit_stores()
            self.mover.shutdown()
        if self.tiers is not None:
            self.tiers.close()
