"""OffloadingConnector: a CPU tier for KV blocks evicted from (or copied out of) the GPU.

Registered as ``OffloadingConnector``, alias ``cpu_offload``. An offloaded *chunk* holds
``blocks_per_chunk`` consecutive GPU blocks of a request; its key is the chained hash of
its last GPU block (``request.block_hashes[f*i + f - 1]``), which identifies the whole
prefix. See ``docs/offload.md`` for the config keys.

Scheduler side: plans loads at admission (``get_num_new_matched_tokens`` ->
``update_state_after_alloc`` -> :meth:`CPUOffloadingManager.prepare_load`), plans stores of
newly computed full chunks in ``build_connector_meta`` (``prepare_store``), and learns job
completions in ``update_connector_output``: a store becomes visible to lookups only once
its job succeeded; a failed store is dropped (``complete_store(success=False)``).
``request_finished`` delays the free of a request whose stores are still in flight.

Worker side: one :class:`~connectors.offload.transfer.KVBlockMover` (one pinned CPU buffer
allocated in ``register_kv_caches``). Stores planned in step N are submitted at the start
of step N+1 (``bind_connector_metadata``, before the forward) so they never delay step N;
loads are submitted in ``start_load_kv`` and are asynchronous. Preempted requests' stores
are waited for in ``handle_preemptions`` before their blocks can be overwritten.

Job completions travel worker -> scheduler as typed worker metadata
(:class:`OffloadWorkerMetadata`, from ``build_connector_worker_meta``, carried in
``KVConnectorOutput.kv_connector_worker_meta``), never in the stats, so they survive
wrapping in a MultiConnector.
"""

from __future__ import annotations

import collections
import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from connectors.offload.events import ChunkInfo, ChunkInfoTable, to_wire_events
from connectors.offload.manager import CPUOffloadingManager
from kvconnector_core.connector.base import KVConnectorBase_V1, KVConnectorRole
from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorTransferResults
from kvconnector_core.errors import ConfigError, InvariantError
from kvconnector_core.kv_events import MEDIUM_CPU
from kvconnector_core.scheduler.output import yield_req_data

# transfer.METHODS, repeated so that validating a config does not import torch
# (a test checks the two agree).
TRANSFER_METHODS = ("auto", "coalesced", "per_block", "gather")

if TYPE_CHECKING:
    import torch

    from connectors.offload.transfer import KVBlockMover, TransferResult
    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.connector.metadata import KVConnectorOutput
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = [
    "OffloadConfig",
    "OffloadWorkerMetadata",
    "OffloadingConnector",
    "OffloadingConnectorMetadata",
    "TransferJobSpec",
]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ records
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

    Attributes:
        done_job_ids: jobs that completed successfully.
        failed_job_ids: jobs that failed (stores are dropped, loads recomputed).
    """

    done_job_ids: list[int] = msgspec.field(default_factory=list)
    failed_job_ids: list[int] = msgspec.field(default_factory=list)


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """Validated ``extra_config`` of the connector.

    Attributes:
        gpu_block_size: tokens per GPU block (from the KV cache spec).
        blocks_per_chunk: GPU blocks per offloaded chunk (the factor ``f``).
        num_cpu_blocks: offloaded chunks the CPU tier holds.
        cache_policy: eviction policy name.
        enable_events: emit CPU-medium KV events.
        transfer_method: :class:`KVBlockMover` method.
    """

    gpu_block_size: int
    blocks_per_chunk: int
    num_cpu_blocks: int
    cache_policy: str
    enable_events: bool
    transfer_method: str

    @property
    def chunk_tokens(self) -> int:
        """Tokens per offloaded chunk."""
        return self.gpu_block_size * self.blocks_per_chunk

    @classmethod
    def from_extra(cls, extra: dict[str, Any], kv_cache_config: KVCacheConfig | None) -> OffloadConfig:
        """Validate ``extra_config`` against the KV cache layout.

        Raises:
            ConfigError: missing KV cache config, several KV cache groups, a block size
                that is not a multiple of the GPU block size, both ``block_size`` and
                ``blocks_per_chunk``, or no / a non-positive CPU capacity.
        """
        if kv_cache_config is None:
            msg = "OffloadingConnector needs the engine's KV cache config (got None)"
            raise ConfigError(msg)
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            msg = (f"OffloadingConnector supports a single KV cache group; this model has "
                   f"{len(groups)} (hybrid models are a known limitation)")
            raise ConfigError(msg)
        gpu_bs = groups[0].kv_cache_spec.block_size
        factor = _blocks_per_chunk(extra, gpu_bs)
        chunk_bytes = factor * kv_cache_config.bytes_per_block
        if "num_cpu_blocks" in extra and "cpu_bytes" in extra:
            msg = "give either 'num_cpu_blocks' or 'cpu_bytes' in extra_config, not both"
            raise ConfigError(msg)
        if "num_cpu_blocks" in extra:
            num = _int_key(extra, "num_cpu_blocks", "a positive number of offloaded blocks")
        elif "cpu_bytes" in extra:
            num = _int_key(extra, "cpu_bytes", "a positive number of bytes") // chunk_bytes
        else:
            msg = ("OffloadingConnector needs 'num_cpu_blocks' (offloaded blocks) or "
                   f"'cpu_bytes' in extra_config (one offloaded block is {chunk_bytes} bytes)")
            raise ConfigError(msg)
        if num < 1:
            msg = (f"the CPU tier must hold at least one offloaded block of {chunk_bytes} "
                   f"bytes; extra_config gives {num}")
            raise ConfigError(msg)
        method = _str_key(extra, "transfer_method", "auto", "'auto', 'coalesced', 'per_block' or 'gather'")
        if method not in TRANSFER_METHODS:
            # Checked here, with the rest of the config, not when the worker registers.
            msg = (f"OffloadingConnector transfer_method={method!r} is not valid; expected one of "
                   f"{', '.join(TRANSFER_METHODS)}")
            raise ConfigError(msg)
        return cls(gpu_bs, factor, num,
                   _str_key(extra, "cache_policy", "lru", "a cache policy name such as 'lru' or 'arc'"),
                   _bool_key(extra, "enable_events", True),
                   method)


def _int_key(extra: dict[str, Any], key: str, valid: str, default: int | None = None) -> int:
    """Return ``extra[key]`` as an int; a bool, a fraction or a non-numeric string is a ConfigError."""
    value = extra.get(key, default)
    if isinstance(value, bool):
        ok = False
    elif isinstance(value, int):
        return value
    elif isinstance(value, float):
        ok = value.is_integer()
    elif isinstance(value, str):
        ok = value.strip().lstrip("+-").isdigit()
    else:
        ok = False
    if not ok:
        msg = f"OffloadingConnector extra_config {key}={value!r} is not valid; expected an integer, {valid}"
        raise ConfigError(msg)
    return int(value)  # type: ignore[arg-type]


def _bool_key(extra: dict[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    msg = f"OffloadingConnector extra_config {key}={value!r} is not valid; expected true or false"
    raise ConfigError(msg)


def _str_key(extra: dict[str, Any], key: str, default: str, valid: str) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str):
        msg = f"OffloadingConnector extra_config {key}={value!r} is not valid; expected a string, {valid}"
        raise ConfigError(msg)
    return value


def _blocks_per_chunk(extra: dict[str, Any], gpu_bs: int) -> int:
    if "block_size" in extra and "blocks_per_chunk" in extra:
        msg = "give either 'block_size' or 'blocks_per_chunk' in extra_config, not both"
        raise ConfigError(msg)
    if "block_size" in extra:
        tokens = _int_key(extra, "block_size", f"a positive multiple of the GPU block size {gpu_bs}")
        if tokens <= 0 or tokens % gpu_bs:
            msg = (f"extra_config block_size={tokens} must be a positive multiple of the GPU "
                   f"block size {gpu_bs}")
            raise ConfigError(msg)
        return tokens // gpu_bs
    factor = _int_key(extra, "blocks_per_chunk", "the GPU blocks per offloaded block (>= 1)", 1)
    if factor < 1:
        msg = f"extra_config blocks_per_chunk={factor} must be >= 1"
        raise ConfigError(msg)
    return factor


# ------------------------------------------------------------------------------ state
@dataclass(slots=True)
class _ReqState:
    """Scheduler-side view of one request."""

    request: Request
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0  # chunks below this are stored, being stored or were loaded
    store_jobs: set[int] = field(default_factory=set)
    finished: bool = False
    hit_keys: list[bytes] = field(default_factory=list)  # touched when the request finishes


@dataclass(frozen=True, slots=True)
class _JobRecord:
    req_id: str
    keys: tuple[bytes, ...]
    is_store: bool


@dataclass(slots=True)
class _WorkerJob:
    spec: TransferJobSpec
    is_store: bool


class OffloadingConnector(KVConnectorBase_V1):
    """CPU offloading connector (see the module docstring).

    Args:
        config: connector config; ``extra_config`` keys are documented in
            ``docs/offload.md`` (``num_cpu_blocks`` / ``cpu_bytes``, ``block_size`` /
            ``blocks_per_chunk``, ``cache_policy``, ``enable_events``, ``transfer_method``).
        role: scheduler or worker.
        kv_cache_config: the engine's KV cache layout (one group).

    Raises:
        ConfigError: invalid ``extra_config`` (see :meth:`OffloadConfig.from_extra`).
    """

    name: ClassVar[str] = "OffloadingConnector"
    metadata_type: ClassVar[type[KVConnectorMetadata]] = OffloadingConnectorMetadata
    supports_async_load: ClassVar[bool] = True
    has_sync_kv_loads: ClassVar[bool] = False

    def __init__(self, config: KVConnectorConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(config, role, kv_cache_config)
        self.offload_config = OffloadConfig.from_extra(dict(config.extra_config), kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # ================================================================ scheduler side
    def _init_scheduler(self) -> None:
        cfg = self.offload_config
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
        self._job_ids = itertools.count()
        self._pending_loads: list[TransferJobSpec] = []
        self._delayed_free: list[str] = []
        self._gpu_hit_tokens: dict[str, int] = {}

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
        # The GPU prefix hit, for recency (update_state_after_alloc cannot tell hit
        # blocks from blocks cached by this admission's own allocation).
        self._gpu_hit_tokens[request.request_id] = num_computed_tokens
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
        if state is None:
            state = self._reqs[rid] = _ReqState(request)
        keys = self._chunk_keys(request)
        cfg, f = self.offload_config, self.offload_config.blocks_per_chunk
        group = blocks.blocks[0]
        # Blocks already in the GPU prefix cache carry a hash; newly allocated ones do not
        # while a load is pending (their caching is delayed).
        local = next((i for i, b in enumerate(group) if b.block_hash is None), len(group))
        hit_tokens = self._gpu_hit_tokens.pop(rid, None)
        if num_external_tokens == 0:
            # Without a load, this admission's own blocks were cached already.
            local = (hit_tokens or 0) // cfg.gpu_block_size
        num_gpu = num_external_tokens // cfg.gpu_block_size
        # Recency only for real reuse: the chunks this admission hits (GPU prefix hit or
        # this load). Touching a request's own fresh chunks would promote them (ARC: T1
        # -> T2) without any reuse. Committed when the request finishes, after its
        # stores, as vLLM 0.33 does: +1 to +10 points of hit rate for LRU and ARC on the
        # reference chat trace (benchmarks/bench_offload_hits.py).
        state.hit_keys = keys[:(local + num_gpu) // f]
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
        if not self.config.is_kv_producer:  # role kv_consumer: only loads
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
                         hashes[chunk * f - 1] if chunk else None, list(tokens), request.lora_name)

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
            record = self._jobs.pop(job_id, None)
            if record is None:
                continue
            if record.is_store:
                self.manager.complete_store(record.keys, success=success)
                if not success:
                    self._chunk_info.discard(record.keys)
                state = self._reqs.get(record.req_id)
                if state is not None:
                    state.store_jobs.discard(job_id)
            else:
                self.manager.complete_load(record.keys)
        if connector_output.failed_recving:
            # A receive reported failed without its job (e.g. start_load_kv raised before
            # submitting it) must still unpin its CPU entries, or they are never evictable.
            for job_id, record in list(self._jobs.items()):
                if not record.is_store and record.req_id in connector_output.failed_recving:
                    del self._jobs[job_id]
                    self.manager.complete_load(record.keys)
        self._translate_events()
        for rid in connector_output.finished_sending:
            state = self._reqs.get(rid)
            if state is not None and state.finished and not state.store_jobs:
                del self._reqs[rid]

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks while stores read them; otherwise forget the request."""
        rid = request.request_id
        self._gpu_hit_tokens.pop(rid, None)
        state = self._reqs.get(rid)
        if state is not None:
            self.manager.touch(state.hit_keys)
        if state is None or not state.store_jobs:
            self._reqs.pop(rid, None)
            return False, None
        state.finished = True
        self._delayed_free.append(rid)
        return True, None

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

    # ================================================================ worker side
    def _init_worker(self) -> None:
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

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Allocate the (pinned on CUDA) CPU buffer next to the KV cache.

        Raises:
            ConfigError: the layers live in several tensors of different block counts
                (several KV cache groups are not supported).
        """
        from connectors.offload.transfer import KVBlockMover

        cfg = self.offload_config
        try:
            self.mover = KVBlockMover(kv_caches, cfg.num_cpu_blocks * cfg.blocks_per_chunk,
                                      method=cfg.transfer_method)
        except ValueError as exc:
            msg = f"OffloadingConnector cannot use this KV cache: {exc}"
            raise ConfigError(msg) from exc

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
        meta = self._connector_metadata
        if not isinstance(meta, OffloadingConnectorMetadata):
            return OffloadingConnectorMetadata()
        return meta

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the plan and submit the previous step's stores, before this step's forward."""
        super().bind_connector_metadata(connector_metadata)
        if self.mover is not None:
            self._submit_stores()

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
        self._submit_stores()  # no-op unless bind_connector_metadata could not submit
        for job in self._meta().loads:
            self._submit(job, is_store=False)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: loads complete before their request is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        """Nothing per layer: whole blocks of all layers move once per step."""

    def wait_for_save(self) -> None:
        """Queue this step's stores; they are submitted at the start of the next step."""
        meta = self._meta()
        for job in meta.stores:
            self._req_jobs.setdefault(job.req_id, set()).add(job.job_id)
        self._unsubmitted += meta.stores
        self._awaiting_send.update(meta.delayed_free_req_ids)

    def _poll(self) -> KVConnectorTransferResults:
        if self._awaiting_send:
            # A finished request waits on these stores: no later step is coming to
            # submit them for free, so submit now (after this step's forward).
            self._submit_stores(self._awaiting_send)
        if self.mover is not None:
            self._results.extend(self.mover.get_finished())
        while self._results:
            self._record(self._results.popleft())
        out = KVConnectorTransferResults(finished_recving=self._recv_done,
                                         failed_recving=self._recv_failed)
        self._recv_done, self._recv_failed = set(), set()
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

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Legacy form of :meth:`get_transfer_results` (failed loads are reported
        through :meth:`get_block_ids_with_load_errors`)."""
        out = self._poll()
        return out.finished_sending or None, out.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks of loads that failed since the last call."""
        ids, self._invalid_block_ids = self._invalid_block_ids, set()
        return ids

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Bytes and seconds moved since the last call (None when nothing moved)."""
        stats, self._stats = self._stats, {}
        return stats if any(stats.values()) else None

    def build_connector_worker_meta(self) -> OffloadWorkerMetadata | None:
        """The jobs finished since the last call, for the scheduler side (None if none)."""
        if not (self._done_jobs or self._failed_jobs):
            return None
        meta = OffloadWorkerMetadata(done_job_ids=self._done_jobs, failed_job_ids=self._failed_jobs)
        self._done_jobs, self._failed_jobs = [], []
        return meta

    def shutdown(self) -> None:
        """Wait for in-flight transfers (both roles; safe to call twice)."""
        if self.role == KVConnectorRole.WORKER and self.mover is not None:
            self._submit_stores()
            self.mover.shutdown()
