"""Load planning of the offload connector's scheduler side.

``get_num_new_matched_tokens`` finds the longest window-aware hit (in the CPU tier, or
with secondary tiers in a tier too); ``update_state_after_alloc`` records the request
and plans its load (:meth:`CPUOffloadingManager.prepare_load`), moving only the blocks
the engine allocated.

Primitives: :class:`ChunkLoadPlanner`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

from connectors.offload.lookup import longest_hit, needed_chunks
from connectors.offload.records import TransferJobSpec
from connectors.offload.scheduler_state import JobRecord
from kvconnector_core.errors import InvariantError

if TYPE_CHECKING:
    from connectors.offload.manager import OffloadKey, RequestAccess
    from connectors.offload.records import TierRead
    from connectors.offload.scheduler_state import ReqState, SchedulerState
    from connectors.offload.tiers.scheduler import SchedulerTiers
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.request import Request

__all__ = ["ChunkLoadPlanner"]

# A load's blocks: load key -> (group, chunk), in order, and per GPU block to load its
# (GPU block id, chunk key, sub-block of the chunk).
_Where = dict["OffloadKey", tuple[int, int]]
_Pairs = list[tuple[int, "OffloadKey", int]]


class ChunkLoadPlanner:
    """The scheduler side's lookups and load plans (see the module docstring).

    Args:
        state: the scheduler side's shared state.
        loads: False for role ``kv_producer`` (never loads).
    """

    def __init__(self, state: SchedulerState, *, loads: bool) -> None:
        self._state = state
        self._keys = state.keys
        self._loads = loads
        self._gpu_hit_tokens: dict[str, int] = {}
        # Per waiting request, its last one-group CPU hit and what it depended on: a request
        # that cannot be admitted is asked again every step, and each answer walks its hit.
        self._hits: dict[str, tuple[tuple[int, int, int, int], int]] = {}

    def forget(self, req_id: str) -> None:
        """Drop what the lookups noted of a request (finished, forgotten)."""
        self._gpu_hit_tokens.pop(req_id, None)
        self._hits.pop(req_id, None)
        if self._state.tiers is not None:
            self._state.tiers.lookups.forget(req_id)

    # ------------------------------------------------------------------ lookups
    def matched_tokens(self, request: Request, num_computed_tokens: int
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
        keys = self._keys
        ct = keys.chunk_tokens
        hbs = getattr(request, "hash_block_size", None) or keys.gpu_block_size
        num_chunks = len(request.block_hashes) * hbs // ct
        if num_computed_tokens // ct >= num_chunks:
            return 0, False
        if self._state.tiers is not None:
            return self._tiered_matched_tokens(request, num_computed_tokens, num_chunks)
        last_loadable = (request.num_tokens - 1) // keys.gpu_block_size * keys.gpu_block_size
        if keys.one_full_group and ct % hbs == 0:
            hit = self._one_group_hit(request, num_computed_tokens, num_chunks, last_loadable,
                                      ct // hbs)
            return (hit, True) if hit > 0 else (0, False)
        hit = longest_hit(
            keys.groups, self._state.manager.lookup, lambda g, c: keys.key(request, g, c),
            num_computed_tokens=num_computed_tokens, num_chunks=num_chunks,
            last_loadable=last_loadable, chunk_tokens=ct)
        return hit, hit > 0

    def _one_group_hit(self, request: Request, num_computed_tokens: int, num_chunks: int,
                       last_loadable: int, step: int) -> int:
        """The common case, without a key function per chunk: the leading ready chunks
        from the local hit on (what longest_hit computes for one full group).

        Keys are built lazily: a miss costs one key, a hit one key per chunk it covers.
        The same answer again while nothing it read changed (the tier's version).
        """
        rid, ct, manager = request.request_id, self._keys.chunk_tokens, self._state.manager
        depends = (num_computed_tokens, num_chunks, last_loadable, manager.version)
        cached = self._hits.get(rid)
        if cached is not None and cached[0] == depends:
            return cached[1]
        start = num_computed_tokens // ct
        suffix = self._keys.suffixes[0]
        # h + suffix is the OffloadKey (a NewType of bytes: calling it costs a call).
        keys = (h + suffix for h in itertools.islice(
            request.block_hashes, (start + 1) * step - 1, num_chunks * step, step))
        hits = manager.lookup(cast("Iterable[OffloadKey]", keys))
        hit = min((start + hits) * ct, last_loadable) - num_computed_tokens if hits else 0
        self._hits[rid] = (depends, hit)
        return hit

    def _tiered_matched_tokens(self, request: Request, num_computed_tokens: int, num_chunks: int
                               ) -> tuple[int | None, bool]:
        """With tiers: the longest window-aware hit whose chunks are each in the CPU tier
        or in a tier (promoted through a CPU slot); None while a tier is still looking.

        The tiers are asked only when the CPU tier alone does not serve the whole
        prompt. The hit is shortened until its promotions fit in the CPU slots that are
        free or evictable now.
        """
        tiers = self._state.tiers
        assert tiers is not None  # noqa: S101 - only called with tiers
        keys = self._keys
        ct, gpu_bs = keys.chunk_tokens, keys.gpu_block_size
        start = num_computed_tokens // ct
        last = (request.num_tokens - 1) // gpu_bs * gpu_bs

        def hit(lookup: Callable[[Iterable[OffloadKey]], int], last_loadable: int) -> int:
            return longest_hit(keys.groups, lookup, lambda g, c: keys.key(request, g, c),
                               num_computed_tokens=num_computed_tokens, num_chunks=num_chunks,
                               last_loadable=last_loadable, chunk_tokens=ct)

        cpu_hit = hit(self._state.manager.lookup, last)
        if num_computed_tokens + cpu_hit >= min(num_chunks * ct, last):
            return cpu_hit, cpu_hit > 0
        wanted = [keys.key(request, g, c) for g in range(len(keys.groups))
                  for c in range(start, num_chunks)]
        promotable = tiers.promotable(request.request_id, wanted)
        if promotable is None:
            return None, False
        available = _counter(promotable, tiers)
        while (num := hit(available, last)) > cpu_hit:
            end = num_computed_tokens + num
            needed = [keys.key(request, g, c) for g, group in enumerate(keys.groups)
                      for c in needed_chunks(group, num_computed_tokens, end, ct)]
            promote = sum(k in promotable for k in needed)
            if promote <= tiers.room(len(needed) - promote):
                return num, True
            last = (end - 1) // ct * ct  # one chunk shorter: fewer promotions
        return cpu_hit, cpu_hit > 0

    # ------------------------------------------------------------------ load plans
    def plan_load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
                  ) -> None:
        """Record the request and its hit chunks, and plan its load if it has one.

        The load moves, per group, only the new blocks the engine allocated for the
        external tokens; positions out of a group's window hold the null block and are
        skipped (a partial load).

        Raises:
            InvariantError: ``num_external_tokens`` is not a whole number of GPU blocks
                or the blocks to load are not ready (the scheduler then recomputes).
        """
        st, rid = self._state, request.request_id
        # Blocks of an async load are written before the request is ever scheduled.
        st.fence.allocated(b.block_id for group in blocks.blocks for b in group)
        state = st.reqs.get(rid)
        if state is not None and state.forgotten:
            return
        state = st.request_state(request)
        hit_tokens = self._admitted_hit(rid, blocks, num_external_tokens)
        end = hit_tokens + num_external_tokens
        if st.hits_only:
            state.hit_tokens = end
        if num_external_tokens == 0 or any(j.req_id == rid for j in st.pending_loads):
            return
        if num_external_tokens % self._keys.gpu_block_size:
            msg = (f"request {rid}: {num_external_tokens} external tokens is not a whole "
                   f"number of {self._keys.gpu_block_size}-token blocks")
            raise InvariantError(msg)
        where, pairs = self._blocks_to_load(request, blocks, hit_tokens, end)
        st.pending_loads.append(self._load_job(state, where, pairs))
        end_chunk = -(-end // self._keys.chunk_tokens)
        state.next_chunk = [max(n, end_chunk) for n in state.next_chunk]

    def _admitted_hit(self, rid: str, blocks: KVCacheBlocks, num_external_tokens: int) -> int:
        """The GPU prefix hit the request was admitted with (noted by the lookup)."""
        hit_tokens = self._gpu_hit_tokens.pop(rid, None)
        self._hits.pop(rid, None)  # admitted: not asked again unless preempted
        if hit_tokens is not None:
            return hit_tokens
        if not num_external_tokens:
            return 0
        # Not asked first (e.g. another connector won the lookup): blocks of the GPU
        # prefix hit carry a hash; blocks of a pending load do not yet.
        group0 = blocks.blocks[0]
        hashed = next((i for i, b in enumerate(group0) if b.block_hash is None), len(group0))
        return hashed * self._keys.groups[0].block_size

    def _blocks_to_load(self, request: Request, blocks: KVCacheBlocks, start: int, end: int
                        ) -> tuple[_Where, _Pairs]:
        """Per group, the allocated blocks of tokens ``[start, end)`` and their chunks."""
        keys = self._keys
        ct = keys.chunk_tokens
        where: _Where = {}
        pairs: _Pairs = []
        for g, group in enumerate(keys.groups):
            bs = group.block_size
            table = blocks.blocks[g]
            for j in range(start // bs, end // bs):
                block = table[j]
                if block.is_null:  # out of the group's window: nothing to load
                    continue
                key = keys.key(request, g, j * bs // ct)
                where.setdefault(key, (g, j * bs // ct))
                pairs.append((block.block_id, key, j % group.factor))
        return where, pairs

    def _access(self, state: ReqState, where: _Where, keys: list[OffloadKey]
                ) -> RequestAccess | None:
        """Recency (vLLM 0.33): loaded chunks are a reuse, ranked now (LRU) and committed
        when the request finishes; None with recency ``"hits_only"``."""
        if self._state.hits_only:
            return None
        state.access.position.update((k, where[k][1] + 1) for k in keys)
        return state.access

    def _load_job(self, state: ReqState, where: _Where, pairs: _Pairs) -> TransferJobSpec:
        """Pin the CPU chunks, reserve slots for promoted ones, and record the job."""
        st, request = self._state, state.request
        rid, sub, tiers = request.request_id, st.sub_blocks_per_chunk, st.tiers
        cpu_keys = [k for k in where if tiers is None or tiers.in_cpu(k)]
        promoted = [k for k in where if tiers is not None and not tiers.in_cpu(k)]
        spec = st.manager.prepare_load(cpu_keys, self._access(state, where, cpu_keys))
        slot_of = dict(zip(cpu_keys, spec.block_ids, strict=True))
        reads: list[TierRead] = []
        if promoted and tiers is not None:
            reads = self._promote(tiers, state, where, promoted, cpu_keys)
            slot_of.update((r.key, r.cpu_block_ids[0] // sub) for r in reads)
        job = TransferJobSpec(st.new_job_id(), rid, [gpu for gpu, _, _ in pairs],
                              [slot_of[key] * sub + k for _, key, k in pairs], reads)
        st.jobs[job.job_id] = JobRecord(rid, tuple(cpu_keys), is_store=False,
                                        promoted=tuple(promoted))
        return job

    def _promote(self, tiers: SchedulerTiers, state: ReqState, where: _Where,
                 promoted: list[OffloadKey], cpu_keys: list[OffloadKey]) -> list[TierRead]:
        """Reserve CPU slots for the tier chunks of a load; unpin its CPU chunks if not."""
        request = state.request
        try:
            reads = tiers.plan_promotion(request.request_id, promoted)
        except InvariantError:
            self._state.manager.complete_load(cpu_keys)
            raise
        for key in promoted:
            self._state.events.add(key, self._keys.describe(request, *where[key]))
        return reads


def _counter(promotable: set[OffloadKey], tiers: SchedulerTiers
             ) -> Callable[[Iterable[OffloadKey]], int]:
    """A lookup counting the leading keys the CPU tier holds or a tier can promote."""

    def available(ks: Iterable[OffloadKey]) -> int:
        # longest_hit may pass a lazy iterable: count, do not take len().
        n = 0
        for k in ks:
            if k not in promotable and not tiers.in_cpu(k):
                break
            n += 1
        return n

    return available
