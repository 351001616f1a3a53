"""Scheduler side of the CPU offloading connector.

Plans loads at admission (``get_num_new_matched_tokens`` -> ``update_state_after_alloc``
-> :meth:`CPUOffloadingManager.prepare_load`), plans stores of newly computed full
chunks in ``build_connector_meta`` (``prepare_store``), and learns job completions in
``update_connector_output``: a store becomes visible to lookups only once its job
succeeded; a failed store is dropped (``complete_store(success=False)``).
``request_finished`` delays the free of a request whose stores are still in flight.

Failure contract (``docs/failure-contract.md``): ``forget_requests`` drops a request's
unsent loads and makes its stores in flight fail when they complete; ``plan_failed``
releases a plan's loads or stores and re-sends its delayed frees.

Primitives: :class:`OffloadSchedulerSide`.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connectors.offload.events import ChunkInfo, ChunkInfoTable, snapshot_events, to_wire_events
from connectors.offload.manager import CPUOffloadingManager
from connectors.offload.records import OffloadingConnectorMetadata, OffloadWorkerMetadata, TransferJobSpec
from kvconnector_core.connector.roles import KVConnectorSchedulerSide
from kvconnector_core.errors import InvariantError
from kvconnector_core.kv_events import MEDIUM_CPU
from kvconnector_core.request import lora_name_of
from kvconnector_core.scheduler.output import yield_req_data

if TYPE_CHECKING:
    from connectors.offload.config import OffloadConfig
    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorOutput
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["OffloadSchedulerSide"]

logger = logging.getLogger("connectors.offload.connector")


@dataclass(slots=True)
class _ReqState:
    """Scheduler-side view of one request."""

    request: Request
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0  # chunks below this are stored, being stored or were loaded
    store_jobs: set[int] = field(default_factory=set)
    finished: bool = False
    forgotten: bool = False  # the guard said forget it: no new loads or stores


@dataclass(frozen=True, slots=True)
class _JobRecord:
    req_id: str
    keys: tuple[bytes, ...]
    is_store: bool



class OffloadSchedulerSide(KVConnectorSchedulerSide):
    """Scheduler side of the CPU offloading connector (see the module docstring).

    Args:
        config: the connector config (its ``kv_role`` decides loads and stores).
        offload_config: the validated ``extra_config``.
    """

    def __init__(self, config: KVConnectorConfig, offload_config: OffloadConfig) -> None:
        self.config = config
        self.offload_config = cfg = offload_config
        self.manager = CPUOffloadingManager(cfg.num_cpu_blocks, cfg.cache_policy,
                                            enable_events=cfg.enable_events, medium=MEDIUM_CPU)
        # Per stored key: what its wire events need. Only kept with events on (nothing
        # drains it otherwise). Manager events are translated as soon as they happen,
        # so the table always matches the tier (a key evicted and stored again within
        # one take_events window keeps its info).
        self._chunk_info = ChunkInfoTable()
        self._wire_events: list[KVCacheEvent] = []
        self._reqs: dict[str, _ReqState] = {}
        self._jobs: dict[int, _JobRecord] = {}
        self._job_reports: dict[int, tuple[int, bool]] = {}  # job -> (worker reports, all ok)
        self._job_ids = itertools.count()
        self._pending_loads: list[TransferJobSpec] = []
        self._delayed_free: list[str] = []
        # Store jobs whose data cannot be trusted (forgotten requests): failed on completion.
        self._poisoned: set[int] = set()

    def _chunk_keys(self, request: Request) -> list[bytes]:
        f = self.offload_config.blocks_per_chunk
        hashes = request.block_hashes
        return [hashes[f * i + f - 1] for i in range(len(hashes) // f)]

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens loadable from the CPU tier beyond the local hit (always async).

        Only whole leading chunks that are ready count; the end is capped one GPU block
        short of the last prompt token, which the engine always computes. No state is
        changed.
        """
        if not self.config.is_kv_consumer:  # role kv_producer: only stores
            return 0, False
        cfg = self.offload_config
        keys = self._chunk_keys(request)
        start = num_computed_tokens // cfg.chunk_tokens
        if start >= len(keys):
            return 0, False
        hits = self.manager.lookup(keys[start:])
        last_loadable = (request.num_tokens - 1) // cfg.gpu_block_size * cfg.gpu_block_size
        end = min((start + hits) * cfg.chunk_tokens, last_loadable)
        num = end - num_computed_tokens
        return (num, True) if num > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Record the request, touch its chunks, and plan its load if it has one.

        Raises:
            InvariantError: ``num_external_tokens`` is not a whole number of GPU blocks
                or the blocks to load are not ready (the scheduler then recomputes).
        """
        rid = request.request_id
        state = self._reqs.get(rid)
        if state is not None and state.forgotten:
            return
        if state is None:
            state = self._reqs[rid] = _ReqState(request)
        keys = self._chunk_keys(request)
        cfg, f = self.offload_config, self.offload_config.blocks_per_chunk
        group = blocks.blocks[0]
        # Blocks already in the GPU prefix cache carry a hash; newly allocated ones do not.
        local = next((i for i, b in enumerate(group) if b.block_hash is None), len(group))
        num_gpu = num_external_tokens // cfg.gpu_block_size
        # Recency only for real reuse: the chunks this admission hits (GPU prefix hit or
        # this load). Touching a request's own fresh chunks would promote them (ARC: T1
        # -> T2) without any reuse.
        self.manager.touch(keys[:(local + num_gpu) // f])
        if num_external_tokens == 0 or any(j.req_id == rid for j in self._pending_loads):
            return
        if num_external_tokens % cfg.gpu_block_size:
            msg = (f"request {rid}: {num_external_tokens} external tokens is not a whole "
                   f"number of {cfg.gpu_block_size}-token blocks")
            raise InvariantError(msg)
        first_chunk, end_chunk = local // f, -(-(local + num_gpu) // f)
        load_keys = keys[first_chunk:end_chunk]
        spec = self.manager.prepare_load(load_keys)
        subs = [c * f + j for c in spec.block_ids for j in range(f)]
        skip = local - first_chunk * f
        job = TransferJobSpec(next(self._job_ids), rid,
                              [b.block_id for b in group[local:local + num_gpu]],
                              subs[skip:skip + num_gpu])
        self._jobs[job.job_id] = _JobRecord(rid, tuple(load_keys), is_store=False)
        self._pending_loads.append(job)
        state.next_chunk = max(state.next_chunk, end_chunk)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        """Plan this step's stores (chunks complete after this step), emit pending loads."""
        computed: dict[str, int] = {r.req_id: r.num_computed_tokens
                                    for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        stores: list[TransferJobSpec] = []
        new_req_ids = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        for rid, new_ids, resumed in yield_req_data(scheduler_output):
            state = self._reqs.get(rid)
            if state is None:
                continue
            ids = list(new_ids[0]) if new_ids else []
            if resumed or rid in new_req_ids:  # these carry all of the request's blocks
                state.block_ids = ids
            else:
                state.block_ids += ids
            done = computed.get(rid, 0) + scheduler_output.num_scheduled_tokens.get(rid, 0)
            job = self._plan_store(state, done)
            if job is not None:
                stores.append(job)
        preempted = sorted(r for r in scheduler_output.preempted_req_ids if r in self._reqs)
        for rid in preempted:
            self._reqs[rid].block_ids = []  # freed; a resumed request brings all its ids
        meta = OffloadingConnectorMetadata(loads=self._pending_loads, stores=stores,
                                           preempted_req_ids=preempted,
                                           delayed_free_req_ids=self._delayed_free)
        self._pending_loads, self._delayed_free = [], []
        return meta

    def _plan_store(self, state: _ReqState, num_done_tokens: int) -> TransferJobSpec | None:
        if not self.config.is_kv_producer or state.forgotten:  # kv_consumer: only loads
            return None
        cfg, f = self.offload_config, self.offload_config.blocks_per_chunk
        request = state.request
        keys = self._chunk_keys(request)
        num_chunks = min(len(keys), num_done_tokens // cfg.chunk_tokens, len(state.block_ids) // f)
        if num_chunks <= state.next_chunk:
            return None
        wanted = keys[state.next_chunk:num_chunks]
        out = self.manager.prepare_store(wanted)
        self._translate_events()  # evictions, before a re-stored key's info is replaced
        if out is None:
            logger.debug("CPU tier full: store of %d chunks of %s retried next step",
                         len(wanted), request.request_id)
            return None
        first = state.next_chunk
        state.next_chunk = num_chunks
        if not out.keys_to_store:
            return None
        index_of = {k: first + i for i, k in enumerate(wanted)}
        gpu_ids: list[int] = []
        cpu_ids: list[int] = []
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            c = index_of[key]
            gpu_ids += state.block_ids[c * f:(c + 1) * f]
            cpu_ids += [slot * f + j for j in range(f)]
            if cfg.enable_events:
                self._chunk_info.add(key, self._describe(request, c))
        job = TransferJobSpec(next(self._job_ids), request.request_id, gpu_ids, cpu_ids)
        self._jobs[job.job_id] = _JobRecord(request.request_id, out.keys_to_store, is_store=True)
        state.store_jobs.add(job.job_id)
        return job

    def _describe(self, request: Request, chunk: int) -> ChunkInfo:
        f, bs = self.offload_config.blocks_per_chunk, self.offload_config.gpu_block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids[chunk * f * bs:(chunk + 1) * f * bs]
        return ChunkInfo(tuple(hashes[chunk * f:(chunk + 1) * f]),
                         hashes[chunk * f - 1] if chunk else None, list(tokens), lora_name_of(request))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Complete the stores and loads the worker finished; forget sent requests.

        Job completions come from ``connector_output.kv_connector_worker_meta`` (an
        :class:`OffloadWorkerMetadata`); a job reported twice is ignored.
        """
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, OffloadWorkerMetadata):
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
                self.manager.complete_store(record.keys, success=success)
                if not success:
                    self._chunk_info.discard(record.keys)
                state = self._reqs.get(record.req_id)
                if state is not None:
                    state.store_jobs.discard(job_id)
                    self._drop_if_done(state)
            else:
                self.manager.complete_load(record.keys)
        if connector_output.failed_recving:
            # A receive reported failed without its job (e.g. start_load_kv raised before
            # submitting it) must still unpin its CPU entries, or they are never evictable.
            for job_id, record in list(self._jobs.items()):
                if not record.is_store and record.req_id in connector_output.failed_recving:
                    del self._jobs[job_id]
                    self._job_reports.pop(job_id, None)
                    self.manager.complete_load(record.keys)
        self._translate_events()
        for rid in connector_output.finished_sending:
            state = self._reqs.get(rid)
            if state is not None and state.finished and not state.store_jobs:
                del self._reqs[rid]
        if connector_output.finished_sending and self._delayed_free:
            # A delayed free re-sent by plan_failed but reported meanwhile: nothing to send.
            self._delayed_free = [r for r in self._delayed_free if r not in connector_output.finished_sending]

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks while stores read them; otherwise forget the request."""
        rid = request.request_id
        state = self._reqs.get(rid)
        if state is None or not state.store_jobs:
            self._reqs.pop(rid, None)
            return False, None
        state.finished = True
        self._delayed_free.append(rid)
        return True, None

    def forget_requests(self, request_ids: set[str]) -> None:
        """Drop unsent loads of these requests (unpinned), plan nothing more for them,
        and fail their stores in flight when they complete (never visible)."""
        dropped = [j for j in self._pending_loads if j.req_id in request_ids]
        self._pending_loads = [j for j in self._pending_loads if j.req_id not in request_ids]
        for job in dropped:
            self._release_load(job.job_id)
        for rid in request_ids:
            state = self._reqs.get(rid)
            if state is not None:
                state.forgotten = True
                self._poisoned |= state.store_jobs
                self._drop_if_done(state)

    def _drop_if_done(self, state: _ReqState) -> None:
        """Forget a forgotten request's state once no store of it is in flight (nothing
        then needs a delayed free; a later request_finished finds no state)."""
        rid = state.request.request_id
        if state.forgotten and not state.store_jobs and rid not in self._delayed_free:
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
        self._translate_events()

    def _release_load(self, job_id: int) -> None:
        record = self._jobs.pop(job_id, None)
        if record is not None and not record.is_store:
            self.manager.complete_load(record.keys)

    def _fail_store(self, job_id: int, record: _JobRecord) -> None:
        self.manager.complete_store(record.keys, success=False)
        self._chunk_info.discard(record.keys)
        self._poisoned.discard(job_id)
        state = self._reqs.get(record.req_id)
        if state is not None:
            state.store_jobs.discard(job_id)
            self._drop_if_done(state)

    def _translate_events(self) -> None:
        """Turn the manager's events into wire events now, while the chunk info is current."""
        if self.offload_config.enable_events:
            self._wire_events += to_wire_events(self.manager.take_events(), self._chunk_info,
                                                self.offload_config.gpu_block_size)

    def take_events(self) -> list[KVCacheEvent]:
        """CPU-tier stores and removals as self-describing wire events.

        Events are per GPU block hash and reference counted across chunks: a hash is
        announced when the first chunk holding it is stored and removed when the last
        one is evicted, so replaying the stream as a set gives exactly the GPU blocks
        the tier can serve (also when chunks of ``blocks_per_chunk > 1`` share blocks).
        """
        self._translate_events()
        events, self._wire_events = self._wire_events, []
        return events

    def get_event_snapshot(self) -> list[KVCacheEvent]:
        """A clear of the CPU medium, then every block the tier serves now; it supersedes
        every event not yet returned (the guard's resync after a failed ``take_events``).
        Nothing with events off."""
        if not self.offload_config.enable_events:
            return []
        events = snapshot_events(self.manager, self._chunk_info, self.offload_config.gpu_block_size)
        self._wire_events = []  # superseded by the snapshot
        return events
