"""The scheduler-side hooks of :class:`~kvconnector_core.connector.base.KVConnectorBase_V1`.

A mixin of the base class, kept beside it so that each role's hooks read in one place;
connectors subclass :class:`~kvconnector_core.connector.base.KVConnectorBase_V1`, never this.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorOutput

if TYPE_CHECKING:  # the base must not import torch or the KV cache core at import time
    from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput


class _SchedulerHooks(abc.ABC):
    """The scheduler-side hooks (documented on the base class); see the module docstring."""

    _kv_cache_manager: KVCacheManager | None

    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:  # noqa: B027 - optional hook
        """Receive the GPU block pool (scheduler side, opt-in).

        The scheduler calls this exactly once, unconditionally, right after
        the KV cache manager exists. A connector that wants to pin GPU blocks
        (``touch``), release them (``free_blocks``) or walk the prefix cache
        (``get_cached_block``, ``iter_cached_blocks``) keeps the view.
        Default: does nothing.

        Args:
            gpu_block_pool: narrow view of the engine's GPU block pool.
        """

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        """Receive the KV cache manager (scheduler side, optional).

        The kvconnector scheduler does **not** call this: it calls only
        ``bind_gpu_block_pool``. It exists for engines that follow vLLM, which
        call ``bind_kv_cache_manager`` instead; the default stores the manager
        and forwards its block pool to ``bind_gpu_block_pool``, so call one or
        the other, never both.

        Args:
            kv_cache_manager: the engine's KV cache manager.
        """
        self._kv_cache_manager = kv_cache_manager
        self.bind_gpu_block_pool(kv_cache_manager.block_pool)

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Return how many tokens beyond the local hit this connector can load.

        Called when a request with no computed tokens is considered for
        admission; it may be called again for the same request (e.g. when
        admission failed), so it must not change state a repeated call would
        see differently.

        Args:
            request: the waiting request (``request.block_hashes`` are its
                chained block hashes).
            num_computed_tokens: tokens already found in the GPU prefix cache,
                rounded down to a block.

        Returns:
            ``(num_tokens, load_async)``: tokens loadable beyond
            ``num_computed_tokens`` (count only blocks available now; None =
            undecided, ask again next step), and whether the load is
            asynchronous (False when the count is 0). The count may cover
            the whole prompt: see the full-prompt-hit rule in
            :meth:`update_state_after_alloc`.
        """

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Learn the blocks allocated for an admitted request.

        Called after every successful admission allocation, with 0 external
        tokens too (a connector may still plan to save the request). May be
        called a second time for a request with an asynchronous load. Decide
        what to do from ``num_external_tokens``, not from ``blocks``.

        **Full-prompt-hit rule.** ``num_external_tokens`` is this connector's own
        answer, clamped to the prompt: load tokens ``[n, n + num_external_tokens)``
        where ``n`` is the ``num_computed_tokens`` it was asked with, i.e. every
        block that range touches, including a block it ends in part-way
        (``cdiv(n + num_external_tokens, block_size)`` blocks in all). A claim may
        cover the whole prompt: the engine still computes the last prompt token
        (it needs its logits) after the load, rewriting that token's slot with
        the same values. A claim that leaves nothing but the last token to load
        counts as no load (``num_external_tokens=0``). vLLM 0.33 does the same
        for asynchronous loads; its scheduler rejects a synchronous claim of the
        whole prompt, so a connector meant for both engines claims at most
        ``request.num_tokens - 1 - n`` tokens for synchronous loads (and still
        loads the block the claim ends in).

        Args:
            request: the admitted request.
            blocks: all of the request's blocks, per KV cache group.
            num_external_tokens: tokens this connector will load (its answer
                from ``get_num_new_matched_tokens``, or 0 when another
                connector or nobody loads).
        """

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Build this step's plan for the worker side and reset per-step state.

        Called at the end of every ``schedule()``, empty steps included. Must
        not mutate ``scheduler_output``.

        Args:
            scheduler_output: what the scheduler scheduled this step.

        Returns:
            An instance of :attr:`metadata_type` that survives msgpack.
        """

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:  # noqa: B027 - optional hook
        """Learn what the worker side finished this step (scheduler side).

        Args:
            connector_output: the worker's report. Default: ignored.
        """

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request finished; called exactly once, before its blocks are freed.

        Args:
            request: the finished request.
            block_ids: its GPU block ids (first KV cache group).

        Returns:
            ``(delay_free, kv_transfer_params)``: with ``delay_free=True`` the
            scheduler keeps the blocks until the request appears in
            ``finished_sending``; the params (or None) are returned to the
            caller of the engine. Default: ``(False, None)``.
        """
        return False, None

    def forget_requests(self, request_ids: set[str]) -> None:  # noqa: B027 - optional hook
        """Stop planning for these requests (scheduler side, optional; called by the guard).

        The guard calls this after a hook raised in a way that may have left this
        connector's view of these requests wrong (see ``docs/failure-contract.md``).
        From then on the requests are not shown to the connector again except in
        ``request_finished``. A connector with per-request state must plan no new load
        or store for them, drop loads it planned but did not hand to the worker yet
        (releasing what they hold), and never make visible a store of theirs that has
        not completed. It may keep a request's state only while a store of it is in
        flight (so that ``request_finished`` can still delay the free) and must drop
        the rest now: the guard also calls this after ``request_finished`` raised, and
        then no other call about the request follows. Default: does nothing.

        Args:
            request_ids: the requests to forget.
        """

    def plan_failed(self, connector_metadata: KVConnectorMetadata, *, loads_failed: bool,  # noqa: B027 - optional hook
                    stores_failed: bool) -> None:
        """The worker side could not carry out part of a plan (scheduler side, optional).

        Called by the guard, before ``update_connector_output`` of the same step, with
        the plan this connector built for that step. With ``loads_failed`` its loads may
        never have started: the scheduler already treats them as failed (async loads
        as failed receives), so release what they hold. With ``stores_failed`` its
        stores may never have run, or read blocks that changed: never make them visible,
        release what they hold, and make sure requests whose free you delayed are still
        reported in ``finished_sending``. Default: does nothing.

        Args:
            connector_metadata: the failed plan (what ``build_connector_meta`` returned).
            loads_failed: the plan's loads failed.
            stores_failed: the plan's stores failed.
        """

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Return the KV cache events produced since the last call (scheduler side).

        Default: no events.
        """
        return ()

    def get_event_snapshot(self) -> Iterable[KVCacheEvent]:
        """Describe everything the connector holds now, to resync event consumers (scheduler side).

        The engine calls it in place of :meth:`take_events` after ``take_events``
        raised: the events it had drained are lost, so a consumer replaying the
        stream would stay wrong. The snapshot replaces them: for every medium the
        connector reports events for, an ``AllBlocksCleared(medium=M)`` followed by
        ``BlockStored`` events for every block it holds in ``M`` now, with the same
        self-describing fields as its normal events. Events the connector produced
        before the snapshot and has not returned yet must be dropped (the snapshot
        already covers them), and the next :meth:`take_events` continues from the
        snapshot's state. A consumer that applies the snapshot is then exact again.

        The engine does not drain :meth:`take_events` before asking for a snapshot, so
        the snapshot must supersede the queue itself. If it raises, the engine retries
        it a few times at once; if none succeeds, it publishes an
        ``AllBlocksCleared(medium=M)`` for every medium the connector's events named
        (a consumer then holds nothing of the connector, never a stale block) and
        retries the snapshot at every later event take until one succeeds.

        Default: no events (a connector that reports no events has nothing to resync).
        """
        return ()
