"""Load planning of the offload connector's scheduler side.

``get_num_new_matched_tokens`` finds the longest window-aware hit (in the CPU tier, or
with secondary tiers in a tier too); ``update_state_after_alloc`` records the request
and plans its load (:meth:`CPUOffloadingManager.prepare_load`), moving only the blocks
the engine allocated.

Primitives: :class:`LoadPlanning`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

from connectors.offload.lookup import longest_hit, needed_chunks
from connectors.offload.manager import OffloadKey
from connectors.offload.records import TransferJobSpec
from connectors.offload.scheduler_state import JobRecord, ReqState, SchedulerSideState
from kvconnector_core.errors import InvariantError

if TYPE_CHECKING:
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.request import Request

__all__ = ["LoadPlanning"]


class LoadPlanning(SchedulerSideState):
    """The scheduler side's lookups and load plans (see the module docstring)."""

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
            # The same answer again while nothing it read changed (the tier's version).
            rid = request.request_id
            depends = (num_computed_tokens, num_chunks, last_loadable, self.manager.version)
            cached = self._hits.get(rid)
            if cached is not None and cached[0] == depends:
                hit = cached[1]
            else:
                step = ct // hbs
                suffix = self._suffixes[0]
                # h + suffix is the OffloadKey (a NewType of bytes: calling it costs a call).
                keys = (h + suffix for h in itertools.islice(
                    request.block_hashes, (start + 1) * step - 1, num_chunks * step, step))
                hits = self.manager.lookup(cast("Iterable[OffloadKey]", keys))
                hit = min((start + hits) * ct, last_loadable) - num_computed_tokens if hits else 0
                self._hits[rid] = (depends, hit)
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
            state = self._reqs[rid] = ReqState(request, [[] for _ in self._groups],
                                                [0] * len(self._groups))
        cfg = self.offload_config
        ct = cfg.chunk_tokens
        hit_tokens = self._gpu_hit_tokens.pop(rid, None)
        self._hits.pop(rid, None)  # admitted: not asked again unless preempted
        if hit_tokens is None:
            # Not asked first (e.g. another connector won the lookup): blocks of the GPU
            # prefix hit carry a hash; blocks of a pending load do not yet.
            group0 = blocks.blocks[0]
            hashed = next((i for i, b in enumerate(group0) if b.block_hash is None), len(group0))
            hit_tokens = hashed * self._groups[0].block_size if num_external_tokens else 0
        end = hit_tokens + num_external_tokens
        if self._hits_only:
            state.hit_tokens = end
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
        if not self._hits_only:
            # Recency (vLLM 0.33): loaded chunks are a reuse, recorded now (LRU ranks them
            # at once) and committed when the request finishes.
            self.manager.record_access(cpu_keys)
            state.reused.update(cpu_keys)
            state.seen.update((k, where[k][::-1]) for k in cpu_keys)
        job = TransferJobSpec(next(self._job_ids), rid, [gpu for gpu, _, _ in pairs],
                              [slot_of[key] * sub + k for _, key, k in pairs], reads)
        self._jobs[job.job_id] = JobRecord(rid, tuple(cpu_keys), is_store=False,
                                            promoted=tuple(promoted))
        self._pending_loads.append(job)
        end_chunk = -(-end // ct)
        state.next_chunk = [max(n, end_chunk) for n in state.next_chunk]
