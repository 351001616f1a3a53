"""The scheduler's interface to the KV cache: lookups, allocation, freeing."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvconnector_core.kv_cache.coordinator import get_kv_cache_coordinator
from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
from kvconnector_core.kv_events import KVCacheEvent

if TYPE_CHECKING:
    from kvconnector_core.request import Request

__all__ = ["KVCacheBlocks", "KVCacheManager", "PrefixCacheStats"]


@dataclass(slots=True)
class KVCacheBlocks:
    """The blocks of one request (or of one allocation), one list per KV cache group.

    It hides the manager's internal tables from the scheduler and connectors:
    they see blocks and block ids, never the managers.
    """

    blocks: tuple[list[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(a + b for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self) -> tuple[list[int], ...]:
        """Block ids per group."""
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the first group's blocks that are not cached (single group only)."""
        if len(self.blocks) != 1:
            raise ConfigError(
                f"get_unhashed_block_ids needs one KV cache group, got {len(self.blocks)}")
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        """An empty value with the same number of groups."""
        return KVCacheBlocks(tuple([] for _ in self.blocks))


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache lookups since creation (tokens)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """``hits / queries`` (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates and caches KV blocks for requests.

    Args:
        kv_cache_config: pool size and KV cache groups.
        max_model_len: longest sequence a request may reach.
        max_num_batched_tokens: token budget of one scheduler step; with
            ``max_model_len`` it sets each spec's admission cap.
        scheduler_block_size: the scheduler's block size, given explicitly (a
            multiple of ``hash_block_size`` and of every group's block size).
        hash_block_size: tokens per hashed block (the unit of ``Request.block_hashes``).
        enable_caching: enable prefix caching.
        enable_kv_cache_events: record KV events for :meth:`take_events`.
        reserve_full_output: admission reserves blocks for each request's whole output
            (prompt + ``max_tokens``) instead of its current tokens (vLLM 0.33's count);
            see :meth:`admission_tokens`.

    Raises:
        BlockSizeError: inconsistent block sizes.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_num_batched_tokens: int,
        *,
        scheduler_block_size: int,
        hash_block_size: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        reserve_full_output: bool = False,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.reserve_full_output = reserve_full_output
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config,
            max_model_len,
            max_num_batched_tokens,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
        )
        self.block_pool: BlockPool = self.coordinator.block_pool
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple([] for _ in range(self.num_kv_cache_groups)))
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of a request: ``(blocks, number of computed tokens)``.

        The last prompt token is always recomputed (its logits are needed), so
        a hit never covers the whole sequence.
        """
        if not self.enable_caching:
            return self.empty_kv_cache_blocks, 0
        max_hit = request.num_tokens - 1
        blocks, num_hit = self.coordinator.find_longest_cache_hit(request.block_hashes, max_hit)
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit
        return KVCacheBlocks(blocks), num_hit

    def can_ever_fit(self, request: Request) -> bool:
        """Whether the request's full sequence fits an otherwise empty pool.

        Uses each spec's admission cap, so a sliding-window request longer than
        the pool passes (it recycles blocks) and a full-attention request that
        needs more blocks than exist does not.
        """
        total = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        need = self.coordinator.get_num_blocks_to_allocate(
            f"\0probe:{request.request_id}", total, self.empty_kv_cache_blocks.blocks, 0,
            apply_admission_cap=True
        )
        return need <= self.block_pool.num_gpu_blocks - 1

    def admission_tokens(self, request: Request) -> int:
        """Tokens the full-sequence admission check counts for ``request``.

        By default what vLLM 0.33 counts: the tokens the request has now (prompt plus
        the outputs generated so far). With ``reserve_full_output`` the whole sequence
        (prompt + ``max_tokens``) instead: fewer requests run at once, and fewer of
        them are preempted when their outputs grow (``docs/admission.md``). Capped at
        ``max_model_len``; the sliding-window and chunked-local admission caps apply on
        top (``apply_admission_cap``).
        """
        tokens = (request.num_prompt_tokens + request.max_tokens if self.reserve_full_output
                  else request.num_tokens)
        return min(tokens, self.max_model_len)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
    ) -> KVCacheBlocks | None:
        """Allocate blocks for ``num_new_tokens`` new tokens (plus cache hits and external tokens).

        Args:
            request: the request.
            num_new_tokens: tokens to compute this step.
            num_new_computed_tokens: local prefix-cache hit tokens (new requests).
            new_computed_blocks: the blocks of that hit.
            num_lookahead_tokens: extra slots (speculative decoding).
            num_external_computed_tokens: tokens a connector will load.
            delay_cache_blocks: do not cache yet (async loads cache on arrival).
            full_sequence_must_fit: first check, with the admission caps, that the
                request's :meth:`admission_tokens` fit in the free blocks.
            reserved_blocks: free blocks that must stay free (promised elsewhere).

        Returns:
            The newly allocated blocks, or None (nothing changed) if they do not fit.

        Raises:
            ConfigError: nothing to allocate (no new and no external tokens).
        """
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ConfigError(
                f"request {request.request_id!r}: allocate_slots needs num_new_tokens > 0 "
                "or num_external_computed_tokens > 0"
            )
        groups = self.coordinator
        new_blocks_per_group = (
            new_computed_blocks.blocks if new_computed_blocks is not None
            else self.empty_kv_cache_blocks.blocks
        )
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = num_local_computed + num_external_computed_tokens
        num_tokens_need_slot = min(total_computed + num_new_tokens + num_lookahead_tokens,
                                   self.max_model_len)
        free = self.block_pool.get_num_free_blocks() - reserved_blocks

        if full_sequence_must_fit:
            full = max(self.admission_tokens(request), num_tokens_need_slot)
            need_full = groups.get_num_blocks_to_allocate(
                request.request_id, full, new_blocks_per_group, total_computed,
                apply_admission_cap=True
            )
            if need_full > free:
                return None

        # Blocks that left the attention window are released before checking
        # capacity, so even a failed allocation can raise the free count.
        groups.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        free = self.block_pool.get_num_free_blocks() - reserved_blocks

        need = groups.get_num_blocks_to_allocate(
            request.request_id, num_tokens_need_slot, new_blocks_per_group, total_computed
        )
        if need > free:
            return None
        if new_computed_blocks is not None and any(new_blocks_per_group):
            groups.save_new_computed_blocks(request.request_id, new_blocks_per_group,
                                            total_computed)
        new_blocks = groups.allocate_new_blocks(request.request_id, num_tokens_need_slot,
                                                total_computed)
        if self.enable_caching and not delay_cache_blocks:
            groups.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        for group in new_blocks:
            if group:
                return KVCacheBlocks(new_blocks)
        # Nothing new (most decode steps): the shared empty value, not a new object.
        return self.empty_kv_cache_blocks

    def free(self, request: Request) -> None:
        """Release every block of the request (tails first, so they are evicted first)."""
        self.coordinator.free(request.request_id)

    def remove_skipped_blocks(self, request: Request) -> None:
        """Release blocks the request will never read again (sliding window / chunked local)."""
        self.coordinator.remove_skipped_blocks(request.request_id, request.num_computed_tokens)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_computed_tokens`` tokens."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def rollback(self, request: Request, num_valid_tokens: int) -> int:
        """Forget that the request's blocks past ``num_valid_tokens`` hold valid, cached KV.

        Used after a failed KV load: blocks the request owns alone from the first
        invalid one on leave the prefix cache (their contents are garbage), and
        caching resumes from there as the request recomputes. Null blocks the
        recomputation would write to or read from are dropped from the table so
        ``allocate_slots`` gives it real ones.

        If some group cannot resume at ``num_valid_tokens`` (a sliding window
        whose blocks before that point were never computed, only skipped), the
        request's blocks are all freed and 0 is returned: it restarts from scratch.

        Returns:
            The number of valid tokens the request resumes from; the caller sets
            ``request.num_computed_tokens`` to it.
        """
        rid = request.request_id
        managers = self.coordinator.single_type_managers
        for m in managers:
            blocks = m.req_to_blocks.get(rid)
            if not blocks:
                continue
            first_needed = m.get_num_skipped_tokens(num_valid_tokens) // m.block_size
            last_valid = -(-num_valid_tokens // m.block_size)
            if any(b.is_null for b in blocks[first_needed:last_valid]):
                self.coordinator.free(rid)
                return 0
        for m in managers:
            blocks = m.req_to_blocks.get(rid)
            if not blocks:
                continue
            n_valid = num_valid_tokens // m.block_size
            self.block_pool.evict_blocks(
                b.block_id for b in blocks[n_valid:] if b.block_hash is not None and b.ref_cnt == 1
            )
            # Positions to be recomputed must not stay null: cut the table at the
            # first such null; allocate_slots grows it again with real blocks.
            first_needed = m.get_num_skipped_tokens(num_valid_tokens) // m.block_size
            cut = next((i for i in range(first_needed, len(blocks)) if blocks[i].is_null), None)
            if cut is not None:
                removed = blocks[cut:]
                del blocks[cut:]
                self.block_pool.free_blocks(reversed(removed))
            if rid in m.num_cached_block:
                m.num_cached_block[rid] = min(m.num_cached_block[rid], n_valid, len(blocks))
        return num_valid_tokens

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks per group."""
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group."""
        return self.get_blocks(request_id).get_block_ids()

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop blocks whose contents are invalid from the prefix cache."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """KV events recorded since the last call."""
        return self.block_pool.take_events()
