"""What the offload connector's scheduler side and its planners share.

The scheduler side (:class:`~connectors.offload.scheduler.OffloadSchedulerSide`) owns one
:class:`SchedulerState` and hands it to its load planner
(:class:`~connectors.offload.load_planner.ChunkLoadPlanner`) and store planner
(:class:`~connectors.offload.store_planner.ChunkStorePlanner`): the CPU tier's manager, the
per-request records (:class:`ReqState`), the jobs in flight (:class:`JobRecord`), what the
next plan sends, and the store fence. :class:`ChunkKeys` computes the O(1) key and the
description of a chunk.

Primitives: :class:`ReqState`, :class:`JobRecord`, :class:`ChunkKeys`,
:class:`SchedulerState`, :func:`group_suffix`, :data:`NULL_BLOCK_ID`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from connectors.offload.events import ChunkInfo, GroupedEvents
from connectors.offload.fence import StoreFence
from connectors.offload.manager import CPUOffloadingManager, OffloadKey, RequestAccess
from connectors.offload.tiers.base import make_tiers
from connectors.offload.tiers.records import Shard
from connectors.offload.tiers.scheduler import SchedulerTiers
from kvconnector_core.kv_events import MEDIUM_CPU
from kvconnector_core.request import lora_name_of

if TYPE_CHECKING:
    from connectors.offload.config import OffloadConfig, OffloadGroup
    from connectors.offload.records import TierWriteJob, TransferJobSpec
    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.kv_cache.hashing import BlockHash
    from kvconnector_core.request import Request

__all__ = [
    "NULL_BLOCK_ID",
    "ChunkKeys",
    "JobRecord",
    "ReqState",
    "SchedulerState",
    "group_suffix",
]


@dataclass(slots=True)
class ReqState:
    """Scheduler-side view of one request.

    Attributes:
        request: the engine's request.
        block_ids: per KV cache group, the request's GPU block ids.
        next_chunk: per group, the first chunk not stored yet (chunks below are done).
        store_jobs: its store jobs in flight.
        finished: ``request_finished`` came while stores were in flight (delayed free).
        forgotten: the guard said forget it: no new loads or stores.
        access: recency, committed when the request finishes (as vLLM 0.33 does): every
            key it loaded or offered, which were reuses and which its own stores; its
            ``position`` holds each key's chunk-end position for prefix order.
        hit_tokens: recency ``"hits_only"``: tokens the last admission hit (GPU prefix
            plus external load); their whole chunks are touched when the request
            finishes, and nothing else.
    """

    request: Request
    block_ids: list[list[int]] = field(default_factory=list)
    next_chunk: list[int] = field(default_factory=list)
    store_jobs: set[int] = field(default_factory=set)
    finished: bool = False
    forgotten: bool = False
    access: RequestAccess = field(default_factory=RequestAccess)
    hit_tokens: int = 0


@dataclass(frozen=True, slots=True)
class JobRecord:
    """One job in flight, as the scheduler side completes it.

    Attributes:
        req_id: its request ("" for a tier write).
        keys: stores: the keys written; loads and tier writes: the keys pinned.
        is_store: a GPU -> CPU store.
        promoted: loads: tier chunks read into reserved CPU slots.
    """

    req_id: str
    keys: tuple[OffloadKey, ...]
    is_store: bool
    promoted: tuple[OffloadKey, ...] = ()


NULL_BLOCK_ID = 0
"""The pool's null block (vLLM's and kvconnector's): what a block table holds at positions
that left a sliding window or chunk."""


def group_suffix(group: int) -> bytes:
    """The 4 bytes (big-endian group index) that end every offload key of a group."""
    return group.to_bytes(4, "big")


class ChunkKeys:
    """Keys and descriptions of a request's chunks, per KV cache group.

    Args:
        offload_config: the validated settings (groups, chunk and block sizes).
    """

    def __init__(self, offload_config: OffloadConfig) -> None:
        cfg = offload_config
        self.groups: list[OffloadGroup] = list(cfg.groups)
        self.suffixes = [group_suffix(g.index) for g in cfg.groups]
        # Read on every hook call: plain attributes, not the config's properties.
        self.chunk_tokens = cfg.chunk_tokens
        self.gpu_block_size = cfg.gpu_block_size
        self.one_full_group = len(cfg.groups) == 1 and cfg.groups[0].is_full

    def hash_block_size(self, request: Request) -> int:
        """Tokens per entry of ``request.block_hashes``. vLLM's Request has no
        ``hash_block_size``: its hashes are per GPU block (one group under the adapter)."""
        return getattr(request, "hash_block_size", None) or self.gpu_block_size

    def num_chunks(self, request: Request) -> int:
        """Whole chunks the request's block hashes cover."""
        return len(request.block_hashes) * self.hash_block_size(request) // self.chunk_tokens

    def key(self, request: Request, group: int, chunk: int) -> OffloadKey:
        """Key of chunk ``chunk`` of ``group``: the chained hash of its last token's block,
        plus the group. O(1): no list of keys is built (planning is O(new chunks))."""
        hbs = getattr(request, "hash_block_size", None) or self.gpu_block_size
        last = (chunk + 1) * self.chunk_tokens // hbs - 1
        return OffloadKey(request.block_hashes[last] + self.suffixes[group])

    def describe(self, request: Request, g: int, chunk: int) -> ChunkInfo:
        """The GPU blocks of group ``g`` a chunk holds: their hashes, parent and tokens."""
        group, hbs = self.groups[g], self.hash_block_size(request)
        f, bs = group.factor, group.block_size
        hashes = request.block_hashes

        def block_hash(j: int) -> BlockHash:
            return hashes[(j + 1) * bs // hbs - 1]

        first = chunk * f
        tokens = request.all_token_ids[first * bs:(first + f) * bs]
        return ChunkInfo(tuple(block_hash(j) for j in range(first, first + f)),
                         block_hash(first - 1) if first else None, list(tokens),
                         lora_name_of(request))


class SchedulerState:
    """The state the scheduler side and its planners share (see the module docstring).

    Args:
        config: the connector config (its ``kv_role`` decides loads and stores; its world
            size, how many workers report each job).
        offload_config: the validated ``extra_config``.

    Attributes:
        manager: the CPU tier's slots.
        keys: chunk keys and descriptions.
        events: per group and stored key, what its wire events need. Only kept with
            events on (nothing drains it otherwise). Manager events are translated as
            soon as they happen, so the tables always match the tier (a key evicted and
            stored again within one ``take_events`` window keeps its info).
        tiers: the secondary tiers' scheduler half (None without tiers).
        fence: the store fence (:mod:`connectors.offload.fence`).
        reqs: per request id, its record.
        jobs: the jobs in flight by id.
        job_ids: the next job ids.
        pending_loads / delayed_free / pending_tier_writes: what the next plan sends.
        hits_only: recency ``"hits_only"`` (else vLLM 0.33's rule: all keys).
    """

    def __init__(self, config: KVConnectorConfig, offload_config: OffloadConfig) -> None:
        cfg = offload_config
        self.manager = CPUOffloadingManager(cfg.num_cpu_blocks, cfg.cache_policy,
                                            enable_events=cfg.enable_events, medium=MEDIUM_CPU)
        self.keys = ChunkKeys(cfg)
        self.sub_blocks_per_chunk = cfg.sub_blocks_per_chunk
        self.hits_only = cfg.recency == "hits_only"
        self.events = GroupedEvents([g.block_size for g in cfg.groups],
                                    enabled=cfg.enable_events)
        # Every worker keeps its shard of a chunk under its own tier key: ask for all.
        shards = Shard.all_of(config.world_size, config.pipeline_parallel_size)
        self.tiers = SchedulerTiers(
            make_tiers(cfg.tiers, layout=cfg.layout, enable_events=False),
            self.manager, cfg.sub_blocks_per_chunk, shards) if cfg.tiers else None
        self.fence = StoreFence()
        self.reqs: dict[str, ReqState] = {}
        self.jobs: dict[int, JobRecord] = {}
        self.job_ids = itertools.count()
        self.pending_loads: list[TransferJobSpec] = []
        self.delayed_free: list[str] = []
        self.pending_tier_writes: list[TierWriteJob] = []

    def new_job_id(self) -> int:
        """A job id not used before."""
        return next(self.job_ids)

    def request_state(self, request: Request) -> ReqState:
        """The request's record, made empty (one entry per group) when it has none."""
        state = self.reqs.get(request.request_id)
        if state is None:
            n = len(self.keys.groups)
            state = self.reqs[request.request_id] = ReqState(request, [[] for _ in range(n)],
                                                              [0] * n)
        return state
