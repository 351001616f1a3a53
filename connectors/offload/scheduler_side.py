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

With secondary tiers (``extra_config["tiers"]``, see :mod:`connectors.offload.tiering`):
a hit may take each chunk the CPU tier lacks from a tier (window-aware as above; None =
ask again while the tiers look), a load promotes those chunks into reserved CPU slots,
and every successful CPU store is cascaded into the tiers (its slots pinned until the
worker has copied them). Tier keys carry the group like CPU keys.

Failure contract (``docs/failure-contract.md``): ``forget_requests`` drops a request's
unsent loads and makes its stores in flight fail when they complete; ``plan_failed``
releases a plan's loads or stores and re-sends its delayed frees.

Primitives: :class:`OffloadSchedulerSide`, :func:`group_suffix`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connectors.offload._fence import StoreFence
from connectors.offload.events import ChunkInfo, GroupedEvents
from connectors.offload.lookup import longest_hit, needed_chunks
from connectors.offload.manager import CPUOffloadingManager
from connectors.offload.policies import OffloadKey
from connectors.offload.records import (
    OffloadingConnectorMetadata,
    OffloadWorkerMetadata,
    TierWriteJob,
    TransferJobSpec,
)
from connectors.offload.tiering import SchedulerTiers, make_tiers
from kvconnector_core.connector.roles import KVConnectorSchedulerSide
from kvconnector_core.errors import InvariantError
from kvconnector_core.kv_events import MEDIUM_CPU
from kvconnector_core.request import lora_name_of

if TYPE_CHECKING:
    from connectors.offload.config import OffloadConfig
    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorOutput
    from kvconnector_core.kv_cache.hashing import BlockHash
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["OffloadSchedulerSide", "group_suffix"]

logger = logging.getLogger("connectors.offload.connector")


@dataclass(slots=True)
class _ReqState:
    """Scheduler-side view of one request."""

    request: Request
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    next_chunk: list[int] = field(default_factory=list)  # per group: chunks below are done
    store_jobs: set[int] = field(default_factory=set)
    finished: bool = False
    forgotten: bool = False  # the guard said forget it: no new loads or stores
    # Recency, committed when the request finishes (as vLLM 0.33 does): every key it
    # loaded, stored or offered while held, with its (chunk, group) for prefix order, and
    # which of them were reuses (loads and keys found held) rather than its own stores.
    seen: dict[OffloadKey, tuple[int, int]] = field(default_factory=dict)
    reused: set[OffloadKey] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _JobRecord:
    req_id: str
    keys: tuple[OffloadKey, ...]  # stores: keys written; loads and tier writes: keys pinned
    is_store: bool
    promoted: tuple[OffloadKey, ...] = ()  # loads: tier chunks read into reserved CPU slots


# The pool's null block (vLLM's and kvconnector's): what a block table holds at positions
# that left a sliding window or chunk.
_NULL_BLOCK_ID = 0


def group_suffix(group: int) -> bytes:
    """The 4 bytes (big-endian group index) that end every offload key of a group."""
    return group.to_bytes(4, "big")


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
        self._groups = cfg.groups
        self._suffixes = [group_suffix(g.index) for g in cfg.groups]
        # Read on every hook call: plain attributes, not the config's properties.
        self._ct = cfg.chunk_tokens
        self._gpu_bs = cfg.gpu_block_size
        self._one_full_group = len(cfg.groups) == 1 and cfg.groups[0].is_full
        self._loads = config.is_kv_consumer  # role kv_producer: never loads
        self._stores = config.is_kv_producer  # role kv_consumer: never stores
        # Per group and stored key: what its wire events need. Only kept with events on
        # (nothing drains it otherwise). Manager events are translated as soon as they
        # happen, so the tables always match the tier (a key evicted and stored again
        # within one take_events window keeps its info).
        self._events = GroupedEvents([g.block_size for g in cfg.groups], enabled=cfg.enable_events)
        self._reqs: dict[str, _ReqState] = {}
        self._jobs: dict[int, _JobRecord] = {}
        self._job_reports: dict[int, tuple[int, bool]] = {}  # job -> (worker reports, all ok)
        self._job_ids = itertools.count()
        self._pending_loads: list[TransferJobSpec] = []
        self._delayed_free: list[str] = []
        self._gpu_hit_tokens: dict[str, int] = {}
        # Store jobs whose data cannot be trusted (forgotten requests): failed on completion.
        self._poisoned: set[int] = set()
        self.tiers = SchedulerTiers(make_tiers(cfg.tiers, layout=cfg.layout, enable_events=False),
                                    self.manager, cfg.sub_blocks_per_chunk) if cfg.tiers else None
        self._pending_tier_writes: list[TierWriteJob] = []
        self._fence = StoreFence()

    # ------------------------------------------------------------------ keys
    def _num_chunks(self, request: Request) -> int:
        """Whole chunks the request's block hashes cover."""
        return len(request.block_hashes) * self._hash_block_size(request) // self._ct

    def _hash_block_size(self, request: Request) -> int:
        """Tokens per entry of ``request.block_hashes``. vLLM's Request has no
        ``hash_block_size``: its hashes are per GPU block (one group under the adapter)."""
        return getattr(request, "hash_block_size", None) or self._gpu_bs

    def _key(self, request: Request, group: int, chunk: int) -> OffloadKey:
        """Key of chunk ``chunk`` of ``group``: the chained hash of its last token's block,
        plus the group. O(1): no list of keys is built (planning is O(new chunks))."""
        hbs = getattr(request, "hash_block_size", None) or self._gpu_bs
        return OffloadKey(request.block_hashes[(chunk + 1) * self._ct // hbs - 1] + self._suffixes[group])

    # ------------------------------------------------------------------ loads
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Tokens loadable from the CPU tier beyond the local hit (always async).

        A hit ends on a chunk boundary (or one GPU block short of the last prompt token,
        which the engine always computes). It needs, per KV cache group, only what the
        group reads to go on from there: every chunk for full attention, the last
        window's chunks for a sliding-window group, the current attention chunk's for a
        chunked-local group. The longest such hit wins. No state is changed but a note
        of the GPU hit, for the load plan.
        """
        self._gpu_hit_tokens[request.request_id] = num_computed_tokens
        if not self._loads:  # role kv_producer: only stores
            return 0, False
        ct = self._ct
        hbs = getattr(request, "hash_block_size", None) or self._gpu_bs
        num_chunks = len(request.block_hashes) * hbs // ct
        start = num_computed_tokens // ct
        if start >= num_chunks:
            return 0, False
        if self.tiers is not None:
            return self._tiered_matched_tokens(request, num_computed_tokens, num_chunks)
        last_loadable = (request.num_tokens - 1) // self._gpu_bs * self._gpu_bs
        if self._one_full_group and ct % hbs == 0:
            # The common case, without a key function per chunk: the leading ready chunks
            # from the local hit on (what longest_hit computes for one full group). Keys
            # are built lazily: a miss costs one key, a hit one key per chunk it covers.
            step = ct // hbs
            suffix = self._suffixes[0]
            hits = self.manager.lookup(OffloadKey(h + suffix) for h in itertools.islice(
                request.block_hashes, (start + 1) * step - 1, num_chunks * step, step))
            hit = min((start + hits) * ct, last_loadable) - num_computed_tokens if hits else 0
            return (hit, True) if hit > 0 else (0, False)
        hit = longest_hit(
            self._groups, self.manager.lookup, lambda g, c: self._key(request, g, c),
            num_computed_tokens=num_computed_tokens, num_chunks=num_chunks,
            last_loadable=last_loadable, chunk_tokens=ct)
        return hit, hit > 0

    def _tiered_matched_tokens(self, request: Request, num_computed_tokens: int, num_chunks: int
                               ) -> tuple[int | None, bool]:
        """With tiers: the longest window-aware hit whose chunks are each in the CPU tier
        or in a tier (promoted through a CPU slot); None while a tier is still looking.

        The tiers are asked only when the CPU tier alone does not serve the whole
        prompt. The hit is shortened until its promotions fit in the CPU slots that are
        free or evictable now.
        """
        assert self.tiers is not None  # noqa: S101 - only called with tiers
        cfg, tiers = self.offload_config, self.tiers
        ct, start = cfg.chunk_tokens, num_computed_tokens // cfg.chunk_tokens
        last = (request.num_tokens - 1) // cfg.gpu_block_size * cfg.gpu_block_size

        def hit(lookup: Callable[[Iterable[OffloadKey]], int], last_loadable: int) -> int:
            return longest_hit(self._groups, lookup, lambda g, c: self._key(request, g, c),
                               num_computed_tokens=num_computed_tokens, num_chunks=num_chunks,
                               last_loadable=last_loadable, chunk_tokens=ct)

        cpu_hit = hit(self.manager.lookup, last)
        if num_computed_tokens + cpu_hit >= min(num_chunks * ct, last):
            return cpu_hit, cpu_hit > 0
        keys = [self._key(request, g, c) for g in range(len(self._groups)) for c in range(start, num_chunks)]
        promotable = tiers.promotable(request.request_id, keys)
        if promotable is None:
            return None, False

        def available(ks: Iterable[OffloadKey]) -> int:
            # longest_hit may pass a lazy iterable: count, do not take len().
            n = 0
            for k in ks:
                if k not in promotable and not tiers.in_cpu(k):
                    break
                n += 1
            return n

        while (num := hit(available, last)) > cpu_hit:
            end = num_computed_tokens + num
            needed = [self._key(request, g, c) for g, group in enumerate(self._groups)
                      for c in needed_chunks(group, num_computed_tokens, end, ct)]
            promote = sum(k in promotable for k in needed)
            if promote <= tiers.room(len(needed) - promote):
                return num, True
            last = (end - 1) // ct * ct  # one chunk shorter: fewer promotions
        return cpu_hit, cpu_hit > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Record the request and its hit chunks, and plan its load if it has one.

        The load moves, per group, only the new blocks the engine allocated for the
        external tokens; positions out of a group's window hold the null block and are
        skipped (a partial load).

        Raises:
            InvariantError: ``num_external_tokens`` is not a whole number of GPU blocks
                or the blocks to load are not ready (the scheduler then recomputes).
        """
        rid = request.request_id
        # Blocks of an async load are written before the request is ever scheduled.
        self._fence.allocated(b.block_id for group in blocks.blocks for b in group)
        state = self._reqs.get(rid)
        if state is not None and state.forgotten:
            return
        if state is None:
            state = self._reqs[rid] = _ReqState(request, [[] for _ in self._groups],
                                                [0] * len(self._groups))
        cfg = self.offload_config
        ct = cfg.chunk_tokens
        hit_tokens = self._gpu_hit_tokens.pop(rid, None)
        if hit_tokens is None:
            # Not asked first (e.g. another connector won the lookup): blocks of the GPU
            # prefix hit carry a hash; blocks of a pending load do not yet.
            group0 = blocks.blocks[0]
            hashed = next((i for i, b in enumerate(group0) if b.block_hash is None), len(group0))
            hit_tokens = hashed * self._groups[0].block_size if num_external_tokens else 0
        end = hit_tokens + num_external_tokens
        if num_external_tokens == 0 or any(j.req_id == rid for j in self._pending_loads):
            return
        if num_external_tokens % cfg.gpu_block_size:
            msg = (f"request {rid}: {num_external_tokens} external tokens is not a whole "
                   f"number of {cfg.gpu_block_size}-token blocks")
            raise InvariantError(msg)
        where: dict[OffloadKey, tuple[int, int]] = {}  # load key -> (group, chunk), in order
        pairs: list[tuple[int, OffloadKey, int]] = []  # (GPU block id, chunk key, sub-block)
        for g, group in enumerate(self._groups):
            bs = group.block_size
            table = blocks.blocks[g]
            for j in range(hit_tokens // bs, end // bs):
                block = table[j]
                if block.is_null:  # out of the group's window: nothing to load
                    continue
                key = self._key(request, g, j * bs // ct)
                where.setdefault(key, (g, j * bs // ct))
                pairs.append((block.block_id, key, j % group.factor))
        sub = cfg.sub_blocks_per_chunk
        tiers = self.tiers
        cpu_keys = [k for k in where if tiers is None or tiers.in_cpu(k)]
        promoted = [k for k in where if tiers is not None and not tiers.in_cpu(k)]
        spec = self.manager.prepare_load(cpu_keys)
        slot_of = dict(zip(cpu_keys, spec.block_ids, strict=True))
        reads = []
        if promoted and tiers is not None:
            try:
                reads = tiers.plan_promotion(rid, promoted)
            except InvariantError:
                self.manager.complete_load(cpu_keys)
                raise
            slot_of.update((r.key, r.cpu_block_ids[0] // sub) for r in reads)
            for key in promoted:
                self._events.add(key, self._describe(request, *where[key]))
        # Recency (vLLM 0.33): loaded chunks are a reuse, recorded now (LRU ranks them at
        # once) and committed when the request finishes.
        self.manager.record_access(cpu_keys)
        state.reused.update(cpu_keys)
        state.seen.update((k, where[k][::-1]) for k in cpu_keys)
        job = TransferJobSpec(next(self._job_ids), rid, [gpu for gpu, _, _ in pairs],
                              [slot_of[key] * sub + k for _, key, k in pairs], reads)
        self._jobs[job.job_id] = _JobRecord(rid, tuple(cpu_keys), is_store=False,
                                            promoted=tuple(promoted))
        self._pending_loads.append(job)
        end_chunk = -(-end // ct)
        state.next_chunk = [max(n, end_chunk) for n in state.next_chunk]

    # ------------------------------------------------------------------ stores
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        """Plan this step's stores (chunks complete after this step), emit pending loads.

        O(new blocks) per request: block ids are appended, keys are computed only for
        the chunks this step completes.
        """
        so = scheduler_output
        stores: list[TransferJobSpec] = []
        fenced = len(self._fence) > 0  # most steps nothing is fenced: no allocation to check
        reqs, scheduled = self._reqs, so.num_scheduled_tokens
        for new in so.scheduled_new_reqs:  # these carry all of the request's blocks
            if fenced:
                self._fence.allocated(b for ids in new.block_ids for b in ids)
            state = reqs.get(new.req_id)
            if state is not None:
                state.block_ids = [list(ids) for ids in new.block_ids] or [[] for _ in self._groups]
                self._plan_and_add(stores, state, new.num_computed_tokens, scheduled.get(new.req_id, 0))
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
            self._plan_and_add(stores, state, before, scheduled.get(rid, 0))
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

    def _plan_and_add(self, stores: list[TransferJobSpec], state: _ReqState, num_computed_tokens: int,
                      num_scheduled_tokens: int) -> None:
        """Plan the request's store of this step, if any, into ``stores``."""
        job = self._plan_store(state, num_computed_tokens, num_computed_tokens + num_scheduled_tokens)
        if job is not None:
            stores.append(job)

    def _store_range(self, state: _ReqState, g: int, num_computed_tokens: int,
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
            while first < end and _NULL_BLOCK_ID in state.block_ids[g][first * f:(first + 1) * f]:
                # Out of the window when the request was admitted: never computed.
                first += 1
        return range(first, end)

    def _plan_store(self, state: _ReqState, num_computed_tokens: int, num_done_tokens: int
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
        self._jobs[job.job_id] = _JobRecord(request.request_id, out.keys_to_store, is_store=True)
        self._fence.add(job.job_id, windowed)
        state.store_jobs.add(job.job_id)
        return job

    def _describe(self, request: Request, g: int, chunk: int) -> ChunkInfo:
        """The GPU blocks of group ``g`` a chunk holds: their hashes, parent and tokens."""
        group, hbs = self._groups[g], self._hash_block_size(request)
        f, bs = group.factor, group.block_size
        hashes = request.block_hashes

        def block_hash(j: int) -> BlockHash:
            return hashes[(j + 1) * bs // hbs - 1]

        first = chunk * f
        tokens = request.all_token_ids[first * bs:(first + f) * bs]
        return ChunkInfo(tuple(block_hash(j) for j in range(first, first + f)),
                         block_hash(first - 1) if first else None, list(tokens), lora_name_of(request))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Complete the stores and loads the worker finished; forget sent requests.

        Job completions come from ``connector_output.kv_connector_worker_meta`` (an
        :class:`OffloadWorkerMetadata`); a job reported twice is ignored.
        """
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

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks while stores read them; otherwise forget the request."""
        rid = request.request_id
        self._gpu_hit_tokens.pop(rid, None)
        if self.tiers is not None:
            self.tiers.lookups.forget(rid)
        state = self._reqs.get(rid)
        if state is not None and state.seen:
            seen = state.seen
            self.manager.finish_request(sorted(seen, key=seen.__getitem__), state.reused)
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
            self._gpu_hit_tokens.pop(rid, None)
            if self.tiers is not None:
                self.tiers.lookups.forget(rid)
            state = self._reqs.get(rid)
            if state is not None:
                state.forgotten = True
                self._poisoned |= state.store_jobs
                self._drop_if_done(state)

    def _drop_if_done(self, state: _ReqState) -> None:
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

    def _complete_load(self, record: _JobRecord, success: bool) -> None:
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
            self._jobs[job_id] = _JobRecord("", pinned, is_store=False)
            self._pending_tier_writes.append(job)

    def _fail_store(self, job_id: int, record: _JobRecord) -> None:
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
