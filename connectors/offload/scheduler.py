"""Scheduler side of the CPU offloading connector.

Plans loads at admission (``get_num_new_matched_tokens`` -> ``update_state_after_alloc``
-> :meth:`CPUOffloadingManager.prepare_load`), plans stores of newly computed full
chunks in ``build_connector_meta`` (``prepare_store``), and learns job completions in
``update_connector_output``: a store becomes visible to lookups only once its job
succeeded; a failed store is dropped (``complete_store(success=False)``).
``request_finished`` delays the free of a request whose stores are still in flight;
sliding-window blocks freed while a store reads them are fenced (:mod:`._fence`).

Hybrid models: every KV cache group is offloaded; a key is a chunk's chained hash plus
its group (4 bytes), as in vLLM 0.33. Lookups are window-aware (a sliding-window group
needs only the chunks of its last window, a chunked-local group those of its current
attention chunk), loads move only the blocks the engine allocated (in-window), and
stores skip chunks whose blocks the engine freed (out of the window before the step).

With secondary tiers (``extra_config["tiers"]``, see :mod:`connectors.offload.tiers.scheduler`):
a hit may take each chunk the CPU tier lacks from a tier (window-aware as above; None =
ask again while the tiers look), a load promotes those chunks into reserved CPU slots,
and every successful CPU store is cascaded into the tiers (its slots pinned until the
worker has copied them). Tier keys carry the group like CPU keys.

Failure contract (``docs/failure-contract.md``): ``forget_requests`` drops a request's
unsent loads and makes its stores in flight fail when they complete; ``plan_failed``
releases a plan's loads or stores and re-sends its delayed frees.

Code layout: the shared state and keys are in :mod:`._sched_state`, the load planning in
:mod:`._sched_loads`, the store planning in :mod:`._sched_stores`; this module completes
jobs, finishes, forgets and fails requests and hands out events.

Primitives: :class:`OffloadSchedulerSide`, :func:`group_suffix`.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from connectors.offload.load_planner import LoadPlanning
from connectors.offload.lookup import needed_chunks
from connectors.offload.manager import OffloadKey
from connectors.offload.records import OffloadingConnectorMetadata, OffloadWorkerMetadata
from connectors.offload.scheduler_state import JobRecord, ReqState, group_suffix
from connectors.offload.store_planner import StorePlanning

if TYPE_CHECKING:
    from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorOutput
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request

__all__ = ["OffloadSchedulerSide", "group_suffix"]


class OffloadSchedulerSide(LoadPlanning, StorePlanning):
    """Scheduler side of the CPU offloading connector (see the module docstring).

    Loads are planned by :class:`~connectors.offload.load_planner.LoadPlanning`, stores
    by :class:`~connectors.offload.store_planner.StorePlanning`; this class completes
    jobs, finishes and forgets requests and hands out events.

    Args:
        config: the connector config (its ``kv_role`` decides loads and stores).
        offload_config: the validated ``extra_config``.
    """

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Complete the stores and loads the worker finished; forget sent requests.

        Job completions come from ``connector_output.kv_connector_worker_meta`` (an
        :class:`OffloadWorkerMetadata`); a job reported twice is ignored.
        """
        if connector_output.invalid_block_ids:
            self._fail_stores_of_failed_loads(connector_output.invalid_block_ids)
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, OffloadWorkerMetadata):
            if not (connector_output.failed_recving or connector_output.finished_sending):
                self._events.translate(self.manager)  # most steps: nothing finished
                return
            meta = OffloadWorkerMetadata()
        for job_id, success in itertools.chain(
                ((j, True) for j in meta.done_job_ids),
                ((j, False) for j in meta.failed_job_ids)):
            if job_id not in self._jobs:
                continue
            # Every worker moves its shard of a job: done once all have reported.
            count, ok = self._job_reports.pop(job_id, (0, True))
            count, ok = count + 1, ok and success
            if count < self.config.world_size:
                self._job_reports[job_id] = (count, ok)
                continue
            success = ok
            record = self._jobs.pop(job_id)
            if job_id in self._poisoned:
                self._poisoned.discard(job_id)
                success = False
            if record.is_store:
                self._fence.release(job_id)
                self.manager.complete_store(record.keys, success=success)
                if not success:
                    self._events.discard(record.keys)
                elif self.tiers is not None:
                    self._plan_tier_writes(record.keys)
                state = self._reqs.get(record.req_id)
                if state is not None:
                    state.store_jobs.discard(job_id)
                    self._drop_if_done(state)
            else:
                self._complete_load(record, success)
        if connector_output.failed_recving:
            # A receive reported failed without its job (e.g. start_load_kv raised before
            # submitting it) must still unpin its CPU entries, or they are never evictable.
            for job_id, record in list(self._jobs.items()):
                if not record.is_store and record.req_id in connector_output.failed_recving:
                    del self._jobs[job_id]
                    self._job_reports.pop(job_id, None)
                    self._complete_load(record, success=False)
        self._events.translate(self.manager)
        for rid in connector_output.finished_sending:
            state = self._reqs.get(rid)
            if state is not None and state.finished and not state.store_jobs:
                del self._reqs[rid]
        if connector_output.finished_sending and self._delayed_free:
            # A delayed free re-sent by plan_failed but reported meanwhile: nothing to send.
            self._delayed_free = [r for r in self._delayed_free if r not in connector_output.finished_sending]

    def _fail_stores_of_failed_loads(self, invalid_block_ids: set[int]) -> None:
        """A sync load into these blocks failed (in a MultiConnector, maybe a sibling's), so
        the forwards that ran on them read blocks never loaded: every store not yet complete
        of a request holding one copied wrong KV, and fails when it completes.

        Every outstanding store, not only the last plan's: under vLLM's async scheduling
        the next step's plan is built before this report arrives, and that step's stores
        of the request are built on the same bad blocks. Failing a store that was in fact
        sound only loses a hit."""
        for job_id, record in self._jobs.items():
            if not record.is_store:
                continue
            state = self._reqs.get(record.req_id)
            if state is None or any(b in invalid_block_ids for ids in state.block_ids for b in ids):
                self._poisoned.add(job_id)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks while stores read them; otherwise forget the request."""
        rid = request.request_id
        self._gpu_hit_tokens.pop(rid, None)
        self._hits.pop(rid, None)
        if self.tiers is not None:
            self.tiers.lookups.forget(rid)
        state = self._reqs.get(rid)
        if state is not None and state.seen:
            seen = state.seen
            self.manager.finish_request(sorted(seen, key=seen.__getitem__), state.reused)
        elif state is not None and state.hit_tokens >= self._ct:
            self._touch_hits(state)
        if state is None or not state.store_jobs:
            self._reqs.pop(rid, None)
            return False, None
        state.finished = True
        self._delayed_free.append(rid)
        return True, None

    def _touch_hits(self, state: ReqState) -> None:
        """Recency ``"hits_only"``: touch the whole chunks the request's admission hit
        (those each group needed), head of the prefix most recent."""
        request, ct = state.request, self._ct
        end = state.hit_tokens // ct * ct
        self.manager.touch([self._key(request, g, c) for g, group in enumerate(self._groups)
                            for c in needed_chunks(group, 0, end, ct)])

    def forget_requests(self, request_ids: set[str]) -> None:
        """Drop unsent loads of these requests (unpinned), plan nothing more for them,
        and fail their stores in flight when they complete (never visible)."""
        dropped = [j for j in self._pending_loads if j.req_id in request_ids]
        self._pending_loads = [j for j in self._pending_loads if j.req_id not in request_ids]
        for job in dropped:
            self._release_load(job.job_id)
        for rid in request_ids:
            self._gpu_hit_tokens.pop(rid, None)
            self._hits.pop(rid, None)
            if self.tiers is not None:
                self.tiers.lookups.forget(rid)
            state = self._reqs.get(rid)
            if state is not None:
                state.forgotten = True
                self._poisoned |= state.store_jobs
                self._drop_if_done(state)

    def _drop_if_done(self, state: ReqState) -> None:
        """Drop a forgotten or finished request's state once no store of it is in flight
        and its delayed free went out (a later request_finished finds no state; a
        finished_sending may have come before its last job's completion)."""
        rid = state.request.request_id
        if (state.forgotten or state.finished) and not state.store_jobs and rid not in self._delayed_free:
            self._reqs.pop(rid, None)

    def plan_failed(self, connector_metadata: KVConnectorMetadata, *, loads_failed: bool,
                    stores_failed: bool) -> None:
        """Release a failed plan's loads (unpin) or stores (dropped, never visible)."""
        plan = connector_metadata
        if not isinstance(plan, OffloadingConnectorMetadata):
            return
        if loads_failed:
            for job in plan.loads:
                self._release_load(job.job_id)
        if not stores_failed:
            return
        for write_job in plan.tier_writes:  # never copied: unpin their CPU slots
            self._release_load(write_job.job_id)
        for job in plan.stores:
            record = self._jobs.pop(job.job_id, None)
            if record is not None:
                self._fail_store(job.job_id, record)
        for rid in plan.preempted_req_ids:  # their stores may have read rewritten blocks
            state = self._reqs.get(rid)
            if state is not None:
                self._poisoned |= state.store_jobs
        # The worker may never have learnt these delayed frees: tell it again (it
        # reports a request it knows no stores of at once).
        self._delayed_free += [r for r in plan.delayed_free_req_ids if r not in self._delayed_free]
        self._events.translate(self.manager)

    def _release_load(self, job_id: int) -> None:
        record = self._jobs.pop(job_id, None)
        if record is not None and not record.is_store:
            self._complete_load(record, success=False)

    def _complete_load(self, record: JobRecord, success: bool) -> None:
        """Unpin a load's CPU chunks; its promoted chunks become visible only if it worked."""
        self.manager.complete_load(record.keys)
        if record.promoted:
            self.manager.complete_store(record.promoted, success=success)
            if not success:
                self._events.discard(record.promoted)

    def _plan_tier_writes(self, keys: tuple[OffloadKey, ...]) -> None:
        """Cascade (write-through): have the worker copy freshly stored chunks into the tiers."""
        assert self.tiers is not None  # noqa: S101 - only called with tiers
        job_id = next(self._job_ids)
        events = self._events
        planned = self.tiers.plan_writes(job_id, keys, lambda k: events.tables[events.group_of(k)].get(k))
        if planned is not None:
            job, pinned = planned
            self._jobs[job_id] = JobRecord("", pinned, is_store=False)
            self._pending_tier_writes.append(job)

    def _fail_store(self, job_id: int, record: JobRecord) -> None:
        self._fence.release(job_id)
        self.manager.complete_store(record.keys, success=False)
        self._events.discard(record.keys)
        self._poisoned.discard(job_id)
        state = self._reqs.get(record.req_id)
        if state is not None:
            state.store_jobs.discard(job_id)
            self._drop_if_done(state)

    def take_events(self) -> list[KVCacheEvent]:
        """CPU-tier stores and removals as self-describing wire events.

        Events are per GPU block hash and reference counted across chunks: a hash is
        announced when the first chunk holding it is stored and removed when the last
        one is evicted, so replaying the stream as a set gives exactly the GPU blocks
        the tier can serve (also when chunks of ``blocks_per_chunk > 1`` share blocks).
        """
        return self._events.take(self.manager)

    def get_event_snapshot(self) -> list[KVCacheEvent]:
        """A clear of the CPU medium, then every block the tier serves now, per KV cache
        group (each with its group index and block size); it supersedes
        every event not yet returned (the guard's resync after a failed ``take_events``).
        Nothing with events off."""
        return self._events.snapshot(self.manager)

    def has_pending_work(self) -> bool:
        """Jobs not completed yet, or loads, delayed frees or tier writes not sent yet."""
        return bool(self._jobs or self._pending_loads or self._delayed_free or self._pending_tier_writes)

    def shutdown(self) -> None:
        """Close the tiers' connections (their lookups run on their own threads)."""
        if self.tiers is not None:
            self.tiers.close()
