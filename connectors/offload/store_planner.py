"""Store planning of the offload connector's scheduler side.

Each step (``build_connector_meta``) the store planner follows the scheduled requests'
block tables and plans the stores of the chunks each request completes
(:meth:`CPUOffloadingManager.prepare_store`). O(new blocks) per request: block ids are
appended, keys computed only for the chunks completed now.

It is not the public :class:`kvconnector_core.connector.planning.StorePlanner`, which
follows one KV cache group a block at a time: this one plans multi-block chunks over every
group, skips sliding-window blocks that left the window, fences the blocks it stores, and
resets preempted requests.

Primitives: :class:`ChunkStorePlanner`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from connectors.offload.records import TransferJobSpec
from connectors.offload.scheduler_state import NULL_BLOCK_ID, JobRecord

if TYPE_CHECKING:
    from connectors.offload.manager import OffloadKey, PrepareStoreOutput, RequestAccess
    from connectors.offload.scheduler_state import ReqState, SchedulerState
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["ChunkStorePlanner"]

logger = logging.getLogger(__name__)

_Where = dict["OffloadKey", tuple[int, int]]  # stored key -> (group, chunk)


class ChunkStorePlanner:
    """The scheduler side's store plans (see the module docstring).

    Args:
        state: the scheduler side's shared state.
        stores: False for role ``kv_consumer`` (never stores).
    """

    def __init__(self, state: SchedulerState, *, stores: bool) -> None:
        self._state = state
        self._keys = state.keys
        self._stores = stores
        self._one_group = len(state.keys.groups) == 1

    def plan_stores(self, scheduler_output: SchedulerOutput) -> list[TransferJobSpec]:
        """This step's stores: the chunks complete after this step's tokens.

        Also follows every scheduled request's block table, notes the blocks the step
        allocated to the store fence, and clears the tables of preempted requests (see
        :meth:`preempted`).
        """
        stores: list[TransferJobSpec] = []
        # Most steps nothing is fenced: no allocation to check.
        fenced = len(self._state.fence) > 0
        self._store_new(scheduler_output, fenced, stores)
        self._store_cached(scheduler_output, fenced, stores)
        return stores

    def preempted(self, scheduler_output: SchedulerOutput) -> list[str]:
        """The known requests preempted this step, sorted; their blocks are freed (a
        resumed request brings all its ids)."""
        so, reqs = scheduler_output, self._state.reqs
        preempted = (sorted(r for r in so.preempted_req_ids if r in reqs)
                     if so.preempted_req_ids else [])
        for rid in preempted:
            reqs[rid].block_ids = self._no_blocks()
        return preempted

    def _no_blocks(self) -> list[list[int]]:
        return [[] for _ in self._keys.groups]

    def _store_new(self, so: SchedulerOutput, fenced: bool, stores: list[TransferJobSpec]
                   ) -> None:
        """Requests scheduled for the first time (or again): they carry all their blocks."""
        reqs, scheduled, ct = self._state.reqs, so.num_scheduled_tokens, self._keys.chunk_tokens
        for new in so.scheduled_new_reqs:
            if fenced:
                self._state.fence.allocated(b for ids in new.block_ids for b in ids)
            state = reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids] or self._no_blocks()
            done = new.num_computed_tokens + scheduled.get(new.req_id, 0)
            # With one group, a request that completed no chunk this step is skipped
            # without a call (what _plan_store would return at once).
            if self._one_group and done // ct <= state.next_chunk[0]:
                continue
            job = self._plan_store(state, new.num_computed_tokens, done)
            if job is not None:
                stores.append(job)

    def _store_cached(self, so: SchedulerOutput, fenced: bool, stores: list[TransferJobSpec]
                      ) -> None:
        """Requests scheduled before: new block ids are appended (all of a resumed one's)."""
        reqs, scheduled, ct = self._state.reqs, so.num_scheduled_tokens, self._keys.chunk_tokens
        cached = so.scheduled_cached_reqs
        for rid, new_ids, before in zip(cached.req_ids, cached.new_block_ids,
                                        cached.num_computed_tokens, strict=False):
            added: Sequence[Sequence[int]] = new_ids or ()
            if fenced:
                self._state.fence.allocated(b for ids in added for b in ids)
            state = reqs.get(rid)
            if state is None:
                continue
            self._add_blocks(state, added, resumed=rid in cached.resumed_req_ids)
            done = before + scheduled.get(rid, 0)
            if self._one_group and done // ct <= state.next_chunk[0]:  # most decode steps
                continue
            job = self._plan_store(state, before, done)
            if job is not None:
                stores.append(job)

    def _add_blocks(self, state: ReqState, added: Sequence[Sequence[int]], *, resumed: bool
                    ) -> None:
        if resumed:  # resumed from preemption: all of its blocks
            state.block_ids = [list(ids) for ids in added] or self._no_blocks()
            return
        for ids, more in zip(state.block_ids, added, strict=False):
            ids += more

    def _store_range(self, state: ReqState, g: int, num_computed_tokens: int,
                     num_done_tokens: int) -> range:
        """Chunks of group ``g`` to store now (``next_chunk`` is advanced by the caller).

        Windowed groups store every new chunk whose blocks are still allocated: this
        step's allocation freed only those before the window at ``num_computed_tokens``
        (the tokens computed before the step), so chunks a one-step prefill computed and
        already left behind are stored too, as vLLM 0.33 does. A hit that ends before
        ``num_done_tokens`` (e.g. the repeated prompt's, one block short of its end)
        needs them: :func:`~connectors.offload.lookup.needed_chunks`. The engine frees
        such blocks at the next step while their store may be in flight: the store
        fence (:mod:`connectors.offload.fence`) makes the worker wait before a block is
        rewritten.
        """
        group = self._keys.groups[g]
        ct = self._keys.chunk_tokens
        end = min(self._keys.num_chunks(state.request), num_done_tokens // ct,
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
        st, keys, request = self._state, self._keys, state.request
        if (len(state.next_chunk) == 1
                and num_done_tokens // keys.chunk_tokens <= state.next_chunk[0]):
            return None  # one group and no chunk completed since the last store (most steps)
        ranges = [self._store_range(state, g, num_computed_tokens, num_done_tokens)
                  for g in range(len(keys.groups))]
        wanted = [(g, c, keys.key(request, g, c)) for g, chunks in enumerate(ranges)
                  for c in chunks]
        if not wanted:
            return None
        access = self._access(state, wanted)
        out = st.manager.prepare_store([key for _, _, key in wanted], access)
        st.events.translate(st.manager)  # evictions, before a re-stored key's info is replaced
        if out is None:
            logger.debug("CPU tier full: store of %d chunks of %s retried next step",
                         len(wanted), request.request_id)
            return None
        where: _Where = {key: (g, c) for g, c, key in wanted}
        for g, chunks in enumerate(ranges):
            state.next_chunk[g] = max(state.next_chunk[g], chunks.stop)
        if not out.keys_to_store:
            return None
        return self._store_job(state, out, where)

    def _access(self, state: ReqState, wanted: list[tuple[int, int, OffloadKey]]
                ) -> RequestAccess | None:
        """The request's recency record with the offered chunks' positions, or None with
        recency ``"hits_only"`` (stores and held keys are no use there)."""
        if self._state.hits_only:
            return None
        state.access.position.update((key, c + 1) for _, c, key in wanted)
        return state.access

    def _store_job(self, state: ReqState, out: PrepareStoreOutput, where: _Where
                   ) -> TransferJobSpec:
        """The GPU -> CPU job of the keys to store, recorded and fenced."""
        st, keys, request = self._state, self._keys, state.request
        sub = st.sub_blocks_per_chunk
        gpu_ids: list[int] = []
        cpu_ids: list[int] = []
        windowed: list[int] = []  # blocks the engine may free while the request runs
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            g, c = where[key]
            group = keys.groups[g]
            f = group.factor
            gpu_ids += state.block_ids[g][c * f:(c + 1) * f]
            if not group.is_full:
                windowed += state.block_ids[g][c * f:(c + 1) * f]
            cpu_ids += [slot * sub + j for j in range(f)]
            if st.events.enabled:
                st.events.add(key, keys.describe(request, g, c))
        job = TransferJobSpec(st.new_job_id(), request.request_id, gpu_ids, cpu_ids)
        st.jobs[job.job_id] = JobRecord(request.request_id, out.keys_to_store, is_store=True)
        st.fence.add(job.job_id, windowed)
        state.store_jobs.add(job.job_id)
        return job
