"""Store planning of the offload connector's scheduler side.

``build_connector_meta`` plans the stores of the chunks each scheduled request completes
this step (:meth:`CPUOffloadingManager.prepare_store`) and emits the pending loads,
delayed frees, tier writes and store-fence flushes as the step's plan. O(new blocks)
per request: block ids are appended, keys computed only for the chunks completed now.

Primitives: :class:`StorePlanning`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from connectors.offload.manager import OffloadKey
from connectors.offload.records import OffloadingConnectorMetadata, TransferJobSpec
from connectors.offload.scheduler_state import NULL_BLOCK_ID, JobRecord, ReqState, SchedulerSideState

if TYPE_CHECKING:
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["StorePlanning"]

logger = logging.getLogger("connectors.offload.connector")


class StorePlanning(SchedulerSideState):
    """The scheduler side's store plans and the step's plan (see the module docstring)."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        """Plan this step's stores (chunks complete after this step), emit pending loads.

        O(new blocks) per request: block ids are appended, keys are computed only for
        the chunks this step completes.
        """
        so = scheduler_output
        stores: list[TransferJobSpec] = []
        fenced = len(self._fence) > 0  # most steps nothing is fenced: no allocation to check
        reqs, scheduled = self._reqs, so.num_scheduled_tokens
        # With one group, a request that completed no chunk this step (most decode steps)
        # is skipped here, without a call (what _plan_store would return at once).
        ct, one_group = self._ct, len(self._groups) == 1
        for new in so.scheduled_new_reqs:  # these carry all of the request's blocks
            if fenced:
                self._fence.allocated(b for ids in new.block_ids for b in ids)
            state = reqs.get(new.req_id)
            if state is not None:
                state.block_ids = [list(ids) for ids in new.block_ids] or [[] for _ in self._groups]
                before = new.num_computed_tokens
                done = before + scheduled.get(new.req_id, 0)
                if not (one_group and done // ct <= state.next_chunk[0]):
                    job = self._plan_store(state, before, done)
                    if job is not None:
                        stores.append(job)
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for rid, new_ids, before in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                                        strict=False):
            if new_ids is None:
                new_ids = ()
            if fenced:
                self._fence.allocated(b for ids in new_ids for b in ids)
            state = reqs.get(rid)
            if state is None:
                continue
            if rid in resumed:  # resumed from preemption: all of its blocks
                state.block_ids = [list(ids) for ids in new_ids] or [[] for _ in self._groups]
            else:
                for ids, added in zip(state.block_ids, new_ids, strict=False):
                    ids += added
            done = before + scheduled.get(rid, 0)
            if one_group and done // ct <= state.next_chunk[0]:
                continue
            job = self._plan_store(state, before, done)
            if job is not None:
                stores.append(job)
        preempted = (sorted(r for r in so.preempted_req_ids if r in self._reqs)
                     if so.preempted_req_ids else [])
        for rid in preempted:
            # Freed; a resumed request brings all its ids.
            self._reqs[rid].block_ids = [[] for _ in self._groups]
        meta = OffloadingConnectorMetadata(loads=self._pending_loads, stores=stores,
                                           preempted_req_ids=preempted,
                                           delayed_free_req_ids=self._delayed_free,
                                           tier_writes=self._pending_tier_writes,
                                           flush_job_ids=self._fence.take())
        self._pending_loads, self._delayed_free, self._pending_tier_writes = [], [], []
        return meta

    def _store_range(self, state: ReqState, g: int, num_computed_tokens: int,
                     num_done_tokens: int) -> range:
        """Chunks of group ``g`` to store now; advances the group's ``next_chunk``.

        Windowed groups store every new chunk whose blocks are still allocated: this
        step's allocation freed only those before the window at ``num_computed_tokens``
        (the tokens computed before the step), so chunks a one-step prefill computed and
        already left behind are stored too, as vLLM 0.33 does. A hit that ends before
        ``num_done_tokens`` (e.g. the repeated prompt's, one block short of its end)
        needs them: :func:`~connectors.offload.lookup.needed_chunks`. The engine frees
        such blocks at the next step while their store may be in flight: the store
        fence (:mod:`._fence`) makes the worker wait before a block is rewritten.
        """
        group = self._groups[g]
        ct = self._ct
        end = min(self._num_chunks(state.request), num_done_tokens // ct,
                  len(state.block_ids[g]) * group.block_size // ct)
        first = state.next_chunk[g]
        if not group.is_full:
            f = group.factor
            freed_blocks = group.first_needed_token(num_computed_tokens) // group.block_size
            first = max(first, -(-freed_blocks // f))
            while first < end and NULL_BLOCK_ID in state.block_ids[g][first * f:(first + 1) * f]:
                # Out of the window when the request was admitted: never computed.
                first += 1
        return range(first, end)

    def _plan_store(self, state: ReqState, num_computed_tokens: int, num_done_tokens: int
                    ) -> TransferJobSpec | None:
        if not self._stores or state.forgotten:  # kv_consumer: only loads
            return None
        request = state.request
        if len(state.next_chunk) == 1 and num_done_tokens // self._ct <= state.next_chunk[0]:
            return None  # one group and no chunk completed since the last store (most steps)
        ranges = [self._store_range(state, g, num_computed_tokens, num_done_tokens)
                  for g in range(len(self._groups))]
        wanted: list[tuple[int, int, OffloadKey]] = [
            (g, c, self._key(request, g, c)) for g, chunks in enumerate(ranges) for c in chunks]
        if not wanted:
            return None
        out = self.manager.prepare_store([key for _, _, key in wanted])
        self._events.translate(self.manager)  # evictions, before a re-stored key's info is replaced
        if out is None:
            logger.debug("CPU tier full: store of %d chunks of %s retried next step",
                         len(wanted), request.request_id)
            return None
        for g, chunks in enumerate(ranges):
            state.next_chunk[g] = max(state.next_chunk[g], chunks.stop)
        where = {key: (g, c) for g, c, key in wanted}
        if not self._hits_only:  # recency "hits_only": stores and held keys are no use
            if out.reused_keys:
                self.manager.record_access(out.reused_keys)
                state.reused.update(out.reused_keys)
                state.seen.update((k, where[k][::-1]) for k in out.reused_keys)
            state.seen.update((k, where[k][::-1]) for k in out.keys_to_store)
        if not out.keys_to_store:
            return None
        sub = self.offload_config.sub_blocks_per_chunk
        gpu_ids: list[int] = []
        cpu_ids: list[int] = []
        windowed: list[int] = []  # blocks the engine may free while the request runs
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            g, c = where[key]
            f = self._groups[g].factor
            gpu_ids += state.block_ids[g][c * f:(c + 1) * f]
            if not self._groups[g].is_full:
                windowed += state.block_ids[g][c * f:(c + 1) * f]
            cpu_ids += [slot * sub + j for j in range(f)]
            if self._events.enabled:
                self._events.add(key, self._describe(request, g, c))
        job = TransferJobSpec(next(self._job_ids), request.request_id, gpu_ids, cpu_ids)
        self._jobs[job.job_id] = JobRecord(request.request_id, out.keys_to_store, is_store=True)
        self._fence.add(job.job_id, windowed)
        state.store_jobs.add(job.job_id)
        return job
