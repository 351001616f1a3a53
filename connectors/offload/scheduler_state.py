"""State and keys shared by the offload connector's scheduler-side pieces.

:class:`SchedulerSideState` holds what the load planning (:mod:`._sched_loads`), the
store planning (:mod:`._sched_stores`) and the completions
(:class:`~connectors.offload.scheduler.OffloadSchedulerSide`) share: the CPU tier's
manager, the requests' views, the jobs in flight and the store fence, plus the O(1) key
of a chunk.

Primitives: :class:`SchedulerSideState`, :func:`group_suffix`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from connectors.offload.events import ChunkInfo, GroupedEvents
from connectors.offload.fence import StoreFence
from connectors.offload.manager import CPUOffloadingManager, OffloadKey
from connectors.offload.records import TierWriteJob, TransferJobSpec
from connectors.offload.tiers import Shard
from connectors.offload.tiers.base import make_tiers
from connectors.offload.tiers.scheduler import SchedulerTiers
from kvconnector_core.connector.roles import KVConnectorSchedulerSide
from kvconnector_core.kv_events import MEDIUM_CPU
from kvconnector_core.request import lora_name_of

if TYPE_CHECKING:
    from connectors.offload.config import OffloadConfig
    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.kv_cache.hashing import BlockHash
    from kvconnector_core.request import Request

__all__ = ["NULL_BLOCK_ID", "JobRecord", "ReqState", "SchedulerSideState", "group_suffix"]


@dataclass(slots=True)
class ReqState:
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
    # Recency "hits_only": tokens the last admission hit (GPU prefix plus external load);
    # their whole chunks are touched when the request finishes, and nothing else.
    hit_tokens: int = 0


@dataclass(frozen=True, slots=True)
class JobRecord:
    req_id: str
    keys: tuple[OffloadKey, ...]  # stores: keys written; loads and tier writes: keys pinned
    is_store: bool
    promoted: tuple[OffloadKey, ...] = ()  # loads: tier chunks read into reserved CPU slots


# The pool's null block (vLLM's and kvconnector's): what a block table holds at positions
# that left a sliding window or chunk.
NULL_BLOCK_ID = 0


def group_suffix(group: int) -> bytes:
    """The 4 bytes (big-endian group index) that end every offload key of a group."""
    return group.to_bytes(4, "big")


class SchedulerSideState(KVConnectorSchedulerSide):
    """What the scheduler-side pieces share (see the module docstring).

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
        self._hits_only = cfg.recency == "hits_only"  # else vLLM 0.33's rule (all keys)
        self._stores = config.is_kv_producer  # role kv_consumer: never stores
        # Per group and stored key: what its wire events need. Only kept with events on
        # (nothing drains it otherwise). Manager events are translated as soon as they
        # happen, so the tables always match the tier (a key evicted and stored again
        # within one take_events window keeps its info).
        self._events = GroupedEvents([g.block_size for g in cfg.groups], enabled=cfg.enable_events)
        self._reqs: dict[str, ReqState] = {}
        self._jobs: dict[int, JobRecord] = {}
        self._job_reports: dict[int, tuple[int, bool]] = {}  # job -> (worker reports, all ok)
        self._job_ids = itertools.count()
        self._pending_loads: list[TransferJobSpec] = []
        self._delayed_free: list[str] = []
        self._gpu_hit_tokens: dict[str, int] = {}
        # Per waiting request, its last one-group CPU hit and what it depended on: a request
        # that cannot be admitted is asked again every step, and each answer walks its hit.
        self._hits: dict[str, tuple[tuple[int, int, int, int], int]] = {}
        # Store jobs whose data cannot be trusted (forgotten requests): failed on completion.
        self._poisoned: set[int] = set()
        # Every worker keeps its shard of a chunk under its own tier key: ask for all.
        self.tiers = SchedulerTiers(make_tiers(cfg.tiers, layout=cfg.layout, enable_events=False),
                                    self.manager, cfg.sub_blocks_per_chunk,
                                    Shard.all_of(config.world_size, config.pipeline_parallel_size),
                                    ) if cfg.tiers else None
        self._pending_tier_writes: list[TierWriteJob] = []
        self._fence = StoreFence()

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
