"""Scheduler side of the CPU offloading connector.

Plans loads at admission (``get_num_new_matched_tokens`` -> ``update_state_after_alloc``
-> :meth:`CPUOffloadingManager.prepare_load`), plans stores of newly computed full
chunks in ``build_connector_meta`` (``prepare_store``), and learns job completions in
``update_connector_output``: a store becomes visible to lookups only once its job
succeeded; a failed store is dropped (``complete_store(success=False)``).
``request_finished`` delays the free of a request whose stores are still in flight;
sliding-window blocks freed while a store reads them are fenced (:mod:`connectors.offload.fence`).

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

The side owns a :class:`~connectors.offload.load_planner.ChunkLoadPlanner` (lookups, load
plans) and a :class:`~connectors.offload.store_planner.ChunkStorePlanner` (store plans), both
working on its :class:`~connectors.offload.scheduler_state.SchedulerState`; it completes
jobs, finishes, forgets and fails requests and hands out events itself.

Primitives: :class:`OffloadSchedulerSide`.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from connectors.offload.load_planner import ChunkLoadPlanner
from connectors.offload.lookup import needed_chunks
from connectors.offload.records import OffloadingConnectorMetadata, OffloadWorkerMetadata
from connectors.offload.scheduler_state import JobRecord, ReqState, SchedulerState
from connectors.offload.store_planner import ChunkStorePlanner
from kvconnector_core.connector.base import KVConnectorSchedulerSide

if TYPE_CHECKING:
    from connectors.offload.config import OffloadConfig
    from connectors.offload.manager import CPUOffloadingManager, OffloadKey
    from connectors.offload.scheduler_state import ChunkKeys
    from connectors.offload.tiers.scheduler import SchedulerTiers
    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorOutput
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["OffloadSchedulerSide"]


class OffloadSchedulerSide(KVConnectorSchedulerSide):
    """Scheduler side of the CPU offloading connector (see the module docstring).

    Args:
        config: the connector config (its ``kv_role`` decides loads and stores).
        offload_config: the validated ``extra_config``.

    Attributes:
        state: what the side and its planners share (requests, jobs, the next plan).
        load_planner: lookups and load plans.
        store_planner: store plans.
    """

    def __init__(self, config: KVConnectorConfig, offload_config: OffloadConfig) -> None:
        self.config = config
        self.offload_config = offload_config
        self.state = SchedulerState(config, offload_config)
        self.load_planner = ChunkLoadPlanner(self.state, loads=config.is_kv_consumer)
        self.store_planner = ChunkStorePlanner(self.state, stores=config.is_kv_producer)
        self._job_reports: dict[int, tuple[int, bool]] = {}  # job -> (worker reports, all ok)
        # Store jobs whose data cannot be trusted (forgotten requests): failed on completion.
        self._poisoned: set[int] = set()

    @property
    def manager(self) -> CPUOffloadingManager:
        """The CPU tier's slots."""
        return self.state.manager

    @property
    def tiers(self) -> SchedulerTiers | None:
        """The secondary tiers' scheduler half (None without tiers)."""
        return self.state.tiers

    @property
    def keys(self) -> ChunkKeys:
        """Chunk keys and descriptions."""
        return self.state.keys

    # ------------------------------------------------------------------ planning
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens loadable from the CPU tier beyond the local hit (always async); see
        :meth:`ChunkLoadPlanner.matched_tokens`."""
        return self.load_planner.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Record the request and plan its load if it has one; see
        :meth:`ChunkLoadPlanner.plan_load`.

        Raises:
            InvariantError: ``num_external_tokens`` is not a whole number of GPU blocks
                or the blocks to load are not ready (the scheduler then recomputes).
        """
        self.load_planner.plan_load(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> OffloadingConnectorMetadata:
        """Plan this step's stores (chunks complete after this step), emit pending loads,
        delayed frees, tier writes and store-fence flushes.

        O(new blocks) per request: block ids are appended, keys are computed only for
        the chunks this step completes.
        """
        st = self.state
        stores = self.store_planner.plan_stores(scheduler_output)
        preempted = self.store_planner.preempted(scheduler_output)
        meta = OffloadingConnectorMetadata(loads=st.pending_loads, stores=stores,
                                           preempted_req_ids=preempted,
                                           delayed_free_req_ids=st.delayed_free,
                                           tier_writes=st.pending_tier_writes,
                                           flush_job_ids=st.fence.take())
        st.pending_loads, st.delayed_free, st.pending_tier_writes = [], [], []
        return meta

    # ------------------------------------------------------------------ completions
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Complete the stores and loads the worker finished; forget sent requests.

        Job completions come from ``connector_output.kv_connector_worker_meta`` (an
        :class:`OffloadWorkerMetadata`); a job reported twice is ignored.
        """
        out, st = connector_output, self.state
        if out.invalid_block_ids:
            self._fail_stores_of_failed_loads(out.invalid_block_ids)
        meta = out.kv_connector_worker_meta
        if not isinstance(meta, OffloadWorkerMetadata):
            if not (out.failed_recving or out.finished_sending):
                st.events.translate(st.manager)  # most steps: nothing finished
                return
            meta = OffloadWorkerMetadata()
        for job_id, success in itertools.chain(((j, True) for j in meta.done_job_ids),
                                               ((j, False) for j in meta.failed_job_ids)):
            self._job_reported(job_id, success)
        if out.failed_recving:
            self._fail_unreported_receives(out.failed_recving)
        st.events.translate(st.manager)
        if out.finished_sending:
            self._sent(out.finished_sending)

    def _job_reported(self, job_id: int, success: bool) -> None:
        """One worker's report of a job: every worker moves its shard of a job, so the job
        is complete once all have reported."""
        st = self.state
        if job_id not in st.jobs:
            return
        count, ok = self._job_reports.pop(job_id, (0, True))
        count, ok = count + 1, ok and success
        if count < self.config.world_size:
            self._job_reports[job_id] = (count, ok)
            return
        record = st.jobs.pop(job_id)
        if job_id in self._poisoned:
            self._poisoned.discard(job_id)
            ok = False
        if record.is_store:
            self._complete_store(job_id, record, ok)
        else:
            self._complete_load(record, ok)

    def _fail_unreported_receives(self, failed_recving: set[str]) -> None:
        """A receive reported failed without its job (e.g. start_load_kv raised before
        submitting it) must still unpin its CPU entries, or they are never evictable."""
        st = self.state
        for job_id, record in list(st.jobs.items()):
            if not record.is_store and record.req_id in failed_recving:
                del st.jobs[job_id]
                self._job_reports.pop(job_id, None)
                self._complete_load(record, success=False)

    def _sent(self, finished_sending: set[str]) -> None:
        """Forget finished requests whose delayed free went out."""
        st = self.state
        for rid in finished_sending:
            state = st.reqs.get(rid)
            if state is not None and state.finished and not state.store_jobs:
                del st.reqs[rid]
        if st.delayed_free:
            # A delayed free re-sent by plan_failed but reported meanwhile: nothing to send.
            st.delayed_free = [r for r in st.delayed_free if r not in finished_sending]

    def _fail_stores_of_failed_loads(self, invalid_block_ids: set[int]) -> None:
        """A sync load into these blocks failed (in a MultiConnector, maybe a sibling's), so
        the forwards that ran on them read blocks never loaded: every store not yet complete
        of a request holding one copied wrong KV, and fails when it completes.

        Every outstanding store, not only the last plan's: under vLLM's async scheduling
        the next step's plan is built before this report arrives, and that step's stores
        of the request are built on the same bad blocks. Failing a store that was in fact
        sound only loses a hit."""
        st = self.state
        for job_id, record in st.jobs.items():
            if not record.is_store:
                continue
            state = st.reqs.get(record.req_id)
            if state is None or any(b in invalid_block_ids for ids in state.block_ids
                                    for b in ids):
                self._poisoned.add(job_id)

    def _complete_store(self, job_id: int, record: JobRecord, success: bool) -> None:
        """A store is visible only if it worked; a stored chunk cascades into the tiers."""
        st = self.state
        st.fence.release(job_id)
        st.manager.complete_store(record.keys, success=success)
        if not success:
            st.events.discard(record.keys)
        elif st.tiers is not None:
            self._plan_tier_writes(record.keys)
        state = st.reqs.get(record.req_id)
        if state is not None:
            state.store_jobs.discard(job_id)
            self._drop_if_done(state)

    def _fail_store(self, job_id: int, record: JobRecord) -> None:
        self._poisoned.discard(job_id)
        self._complete_store(job_id, record, success=False)

    def _release_load(self, job_id: int) -> None:
        record = self.state.jobs.pop(job_id, None)
        if record is not None and not record.is_store:
            self._complete_load(record, success=False)

    def _complete_load(self, record: JobRecord, success: bool) -> None:
        """Unpin a load's CPU chunks; its promoted chunks become visible only if it worked."""
        st = self.state
        st.manager.complete_load(record.keys)
        if record.promoted:
            st.manager.complete_store(record.promoted, success=success)
            if not success:
                st.events.discard(record.promoted)

    def _plan_tier_writes(self, keys: tuple[OffloadKey, ...]) -> None:
        """Cascade (write-through): have the worker copy freshly stored chunks into the tiers."""
        st = self.state
        assert st.tiers is not None  # noqa: S101 - only called with tiers
        job_id = st.new_job_id()
        events = st.events
        planned = st.tiers.plan_writes(job_id, keys,
                                       lambda k: events.tables[events.group_of(k)].get(k))
        if planned is not None:
            job, pinned = planned
            st.jobs[job_id] = JobRecord("", pinned, is_store=False)
            st.pending_tier_writes.append(job)

    # ------------------------------------------------------------------ requests
    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks while stores read them; otherwise forget the request."""
        st, rid = self.state, request.request_id
        self.load_planner.forget(rid)
        state = st.reqs.get(rid)
        if state is not None and state.access.seen:
            access = state.access
            position = access.position
            keys = sorted(access.seen, key=lambda k: (position[k], k[-4:]))  # then group
            st.manager.finish_request(keys, access.reused, access.stored_only)
        elif state is not None and state.hit_tokens >= st.keys.chunk_tokens:
            self._touch_hits(state)
        if state is None or not state.store_jobs:
            st.reqs.pop(rid, None)
            return False, None
        state.finished = True
        st.delayed_free.append(rid)
        return True, None

    def _touch_hits(self, state: ReqState) -> None:
        """Recency ``"hits_only"``: touch the whole chunks the request's admission hit
        (those each group needed), head of the prefix most recent."""
        keys, request = self.state.keys, state.request
        ct = keys.chunk_tokens
        end = state.hit_tokens // ct * ct
        self.state.manager.touch([keys.key(request, g, c) for g, group in enumerate(keys.groups)
                                  for c in needed_chunks(group, 0, end, ct)])

    def forget_requests(self, request_ids: set[str]) -> None:
        """Drop unsent loads of these requests (unpinned), plan nothing more for them,
        and fail their stores in flight when they complete (never visible)."""
        st = self.state
        dropped = [j for j in st.pending_loads if j.req_id in request_ids]
        st.pending_loads = [j for j in st.pending_loads if j.req_id not in request_ids]
        for job in dropped:
            self._release_load(job.job_id)
        for rid in request_ids:
            self.load_planner.forget(rid)
            state = st.reqs.get(rid)
            if state is not None:
                state.forgotten = True
                self._poisoned |= state.store_jobs
                self._drop_if_done(state)

    def _drop_if_done(self, state: ReqState) -> None:
        """Drop a forgotten or finished request's state once no store of it is in flight
        and its delayed free went out (a later request_finished finds no state; a
        finished_sending may have come before its last job's completion)."""
        st, rid = self.state, state.request.request_id
        if ((state.forgotten or state.finished) and not state.store_jobs
                and rid not in st.delayed_free):
            st.reqs.pop(rid, None)

    def plan_failed(self, connector_metadata: KVConnectorMetadata, *, loads_failed: bool,
                    stores_failed: bool) -> None:
        """Release a failed plan's loads (unpin) or stores (dropped, never visible)."""
        plan = connector_metadata
        if not isinstance(plan, OffloadingConnectorMetadata):
            return
        if loads_failed:
            for job in plan.loads:
                self._release_load(job.job_id)
        if stores_failed:
            self._release_stores(plan)
            self.state.events.translate(self.state.manager)

    def _release_stores(self, plan: OffloadingConnectorMetadata) -> None:
        st = self.state
        for write_job in plan.tier_writes:  # never copied: unpin their CPU slots
            self._release_load(write_job.job_id)
        for job in plan.stores:
            record = st.jobs.pop(job.job_id, None)
            if record is not None:
                self._fail_store(job.job_id, record)
        for rid in plan.preempted_req_ids:  # their stores may have read rewritten blocks
            state = st.reqs.get(rid)
            if state is not None:
                self._poisoned |= state.store_jobs
        # The worker may never have learnt these delayed frees: tell it again (it
        # reports a request it knows no stores of at once).
        st.delayed_free += [r for r in plan.delayed_free_req_ids if r not in st.delayed_free]

    # ------------------------------------------------------------------ events, lifecycle
    def take_events(self) -> list[KVCacheEvent]:
        """CPU-tier stores and removals as self-describing wire events.

        Events are per GPU block hash and reference counted across chunks: a hash is
        announced when the first chunk holding it is stored and removed when the last
        one is evicted, so replaying the stream as a set gives exactly the GPU blocks
        the tier can serve (also when chunks of ``blocks_per_chunk > 1`` share blocks).
        """
        return self.state.events.take(self.state.manager)

    def get_event_snapshot(self) -> list[KVCacheEvent]:
        """A clear of the CPU medium, then every block the tier serves now, per KV cache
        group (each with its group index and block size); it supersedes
        every event not yet returned (the guard's resync after a failed ``take_events``).
        Nothing with events off."""
        return self.state.events.snapshot(self.state.manager)

    def has_pending_work(self) -> bool:
        """Jobs not completed yet, or loads, delayed frees or tier writes not sent yet."""
        st = self.state
        return bool(st.jobs or st.pending_loads or st.delayed_free or st.pending_tier_writes)

    def shutdown(self) -> None:
        """Close the tiers' connections (their lookups run on their own threads)."""
        if self.state.tiers is not None:
            self.state.tiers.close()
