"""Continuous-batching scheduler with connector hooks and load-failure recovery.

One :meth:`Scheduler.schedule` call plans a step under a token budget: running
requests first (decode or the next prefill chunk; preempting the newest running
request by recompute when blocks run out), then waiting requests in arrival
order. Admission asks the KV cache manager for the local prefix hit, asks the
connector how many more tokens it can load (``get_num_new_matched_tokens``),
checks with the admission caps that the whole sequence fits, allocates, and
tells the connector (``update_state_after_alloc``). The plan ends with
``build_connector_meta``.

:meth:`Scheduler.update_from_output` applies the worker's report: invalid
blocks first (roll the affected requests back to their first invalid block, or
fail them), then sampled tokens, then the connector's finished transfers.

Failure contract: the connector is called only through a
:class:`~kvconnector_core.connector.guard.GuardedScheduler`, which contains what a hook
raises (see ``docs/failure-contract.md``); blocks written by a connector load become
visible in the prefix cache only after the load is known to have succeeded.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvconnector_core.connector.guard import GuardedScheduler
from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
from kvconnector_core.kv_events import KVCacheEvent
from kvconnector_core.request import Request, RequestStatus
from kvconnector_core.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from kvconnector_core.connector.base import KVConnectorBase_V1

__all__ = ["LOAD_FAILURE_POLICIES", "Scheduler", "SchedulerStats"]

logger = logging.getLogger(__name__)

LOAD_FAILURE_POLICIES = ("recompute", "fail")
"""What to do with a request whose KV load failed: recompute from the first bad block, or fail it."""


@dataclass
class SchedulerStats:
    """Counters of what the scheduler did, since creation.

    Attributes:
        num_steps: ``schedule()`` calls.
        num_prompt_tokens: prompt tokens of all admitted requests (first admission).
        num_prefill_tokens_computed: prompt tokens the model computed for the first time.
        num_gpu_cache_hit_tokens: prompt tokens first served from the GPU prefix cache.
        num_connector_hit_tokens: prompt tokens first served by the connector (successful loads).
        num_recomputed_tokens: prompt tokens computed or loaded again after a preemption or
            a failed load. Each prompt token is counted once in exactly one of the three
            counters above, so they add up to ``num_prompt_tokens`` once all requests finish.
        num_preemptions: requests preempted by recompute.
        num_failed_loads_recovered: requests rolled back and recomputed after a failed load.
        num_requests_failed: requests finished with FINISHED_ERROR.
        num_rejected: requests that can never fit the KV cache.
        connector_errors: per hook name, how many times the connector raised.
    """

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_prefill_tokens_computed: int = 0
    num_gpu_cache_hit_tokens: int = 0
    num_connector_hit_tokens: int = 0
    num_recomputed_tokens: int = 0
    num_preemptions: int = 0
    num_failed_loads_recovered: int = 0
    num_requests_failed: int = 0
    num_rejected: int = 0
    connector_errors: dict[str, int] = field(default_factory=dict)


def _clamp_external(claimed: int, num_tokens: int, num_local: int) -> tuple[int, int]:
    """``(tokens the connector loads, tokens counted as computed by that load)``.

    The full-prompt-hit rule (vLLM 0.33 does the same after an async load): a hit may
    cover the whole prompt; the connector is told its own answer (clamped to the prompt)
    and loads every block it claimed, while the engine still computes the last prompt
    token, whose logits it needs, rewriting that token's slot with the same values. A hit
    that would leave nothing but that last token to load is no load at all.
    """
    claimed = max(0, min(claimed, num_tokens - num_local))
    counted = min(claimed, num_tokens - 1 - num_local)
    return (claimed, counted) if counted > 0 else (0, 0)


class Scheduler:
    """Plans engine steps and keeps requests, blocks and the connector in sync.

    Args:
        kv_cache_config: the KV cache layout.
        max_num_batched_tokens: token budget of one step.
        max_num_seqs: most requests running at once.
        max_model_len: longest sequence a request may reach.
        scheduler_block_size: block size the scheduler aligns to (explicit; see KVCacheManager).
        hash_block_size: tokens per hashed block.
        enable_prefix_caching: reuse cached prefix blocks.
        enable_kv_cache_events: record KV events.
        connector: the scheduler-role connector, or None.
        load_failure_policy: ``"recompute"`` (default) or ``"fail"``.
        reserve_full_output: admit a request only if its whole output fits (see
            :meth:`KVCacheManager.admission_tokens`); default: its current tokens.

    Raises:
        ConfigError: an unknown ``load_failure_policy`` or non-positive budgets.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        enable_prefix_caching: bool = True,
        enable_kv_cache_events: bool = False,
        connector: KVConnectorBase_V1 | None = None,
        load_failure_policy: str = "recompute",
        reserve_full_output: bool = False,
    ) -> None:
        if load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ConfigError(
                f"load_failure_policy={load_failure_policy!r}; valid: {', '.join(LOAD_FAILURE_POLICIES)}"
            )
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or max_model_len < 2:
            raise ConfigError(
                f"max_num_batched_tokens={max_num_batched_tokens}, max_num_seqs={max_num_seqs}, "
                f"max_model_len={max_model_len}; need >= 1, >= 1 and >= 2"
            )
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.hash_block_size = hash_block_size
        self.recompute_on_failure = load_failure_policy == "recompute"
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len,
            max_num_batched_tokens,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            enable_caching=enable_prefix_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            reserve_full_output=reserve_full_output,
        )
        self.block_size = scheduler_block_size
        self.stats = SchedulerStats()
        self.connector: GuardedScheduler | None = None
        """The scheduler-side connector behind its guard, or None."""
        if connector is not None:
            self.connector = GuardedScheduler(connector, errors=self.stats.connector_errors)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        # Requests whose blocks are kept until the connector reports them sent.
        self.delayed_free: dict[str, Request] = {}
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        # Requests with a sync load this step: their loaded blocks are cached
        # only once the worker reports no error for them.
        self._sync_load_reqs: set[str] = set()
        self._worker_events: list[KVCacheEvent] = []
        # Requests finished outside update_from_output's token loop (rejected,
        # failed by policy); reported by the next update_from_output.
        self._finished_out_of_band: list[Request] = []
        self._aborted_while_loading: set[str] = set()
        # Requests whose KV load failed once: they recompute instead of asking
        # the connector again, so a persistently failing connector cannot livelock them.
        self._recompute_only: set[str] = set()
        # Per request, prompt tokens already attributed in the stats (see _account).
        self._prompt_progress: dict[str, int] = {}
        # Requests the worker has been sent as NewRequestData (and not yet finished).
        self._sent_to_worker: set[str] = set()
        # Per request with an async load in flight, where the load starts (its local hit).
        self._async_load_start: dict[str, int] = {}
        # Requests aborted while loading whose connector also asked to delay the free.
        self._delay_free_after_load: set[str] = set()
        # Requests put in WAITING_FOR_REMOTE_KVS whose loads no plan has carried yet (a
        # failed build_connector_meta leaves them to the next plan), and those the step's
        # plan carries: failed receives if the worker reports that the step's loads failed.
        self._unplanned_async_loads: set[str] = set()
        self._step_async_loads: set[str] = set()
        if self.connector is not None:
            # Unconditionally, right after the KV cache manager exists (opt-in hook;
            # the base class default does nothing).
            self.connector.bind_gpu_block_pool(self.kv_cache_manager.block_pool)

    # -- requests --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises:
            ConfigError: duplicate id, or a hash block size other than the scheduler's.
        """
        if request.request_id in self.requests:
            raise ConfigError(f"request id {request.request_id!r} is already in use")
        if request.hash_block_size != self.hash_block_size:
            raise ConfigError(
                f"request {request.request_id!r} hashes blocks of {request.hash_block_size} tokens; "
                f"the scheduler needs hash_block_size={self.hash_block_size}"
            )
        if request.num_prompt_tokens >= self.max_model_len:
            raise ConfigError(
                f"request {request.request_id!r} has {request.num_prompt_tokens} prompt tokens; "
                f"max_model_len={self.max_model_len} allows at most {self.max_model_len - 1}"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        """Whether any request still waits, runs, has blocks held for the connector, or
        finished since the last step.

        The last case makes the engine run one empty step after a finish (as vLLM
        does), so the worker learns ``finished_req_ids`` and connectors meet empty
        steps in kvconnector's engine too. A connector with pending work (a report the
        guard redelivers, a message for its worker side) also keeps the engine stepping.
        """
        return bool(self.waiting or self.running or self.delayed_free or self._aborted_while_loading
                    or self.finished_req_ids
                    or (self.connector is not None and self.connector.has_pending_work()))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached GPU block; False while a request holds blocks.

        The connector's ``reset_cache`` runs first (contained), so blocks it pins
        are released before the pool checks that nothing is in use.
        """
        if self.connector is not None and self.connector.reset_cache() is False:
            return False
        return self.kv_cache_manager.reset_prefix_cache()

    def get_num_unfinished_requests(self) -> int:
        """Waiting plus running requests."""
        return len(self.waiting) + len(self.running)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish (abort) requests from outside, e.g. a client disconnect."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            req.status = status
            # A request aborted while its KV is loading keeps its blocks until the
            # connector reports the load finished (the worker may still be writing them).
            keep = loading and rid not in self.finished_recving_kv_req_ids
            # A reported-but-unconsumed load must not leak into a later request reusing the id.
            self.finished_recving_kv_req_ids.discard(rid)
            self.failed_recving_kv_req_ids.discard(rid)
            if keep:
                self._aborted_while_loading.add(rid)
            self._free_request(req, keep_blocks=keep)

    # -- scheduling ------------------------------------------------------------

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def _account(self, req: Request, source: str, start: int, end: int) -> None:
        """Attribute prompt tokens ``[start, end)`` to ``source`` ("computed", "gpu", "connector").

        Tokens beyond the request's progress count once toward ``source``; tokens
        below it were counted before and now count as recomputed.
        """
        end = min(end, req.num_prompt_tokens)
        if end <= start:
            return
        progress = self._prompt_progress.get(req.request_id, 0)
        first = max(0, end - max(start, progress))
        stats = self.stats
        stats.num_recomputed_tokens += (end - start) - first
        if first:
            self._prompt_progress[req.request_id] = end
            if source == "computed":
                stats.num_prefill_tokens_computed += first
            elif source == "gpu":
                stats.num_gpu_cache_hit_tokens += first
            else:
                stats.num_connector_hit_tokens += first

    def schedule(self) -> SchedulerOutput:
        """Plan one step; see the module docstring for the order of work."""
        self.stats.num_steps += 1
        kvm = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks_of: dict[str, KVCacheBlocks] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        scheduled_resumed: list[Request] = []
        preempted: list[Request] = []

        # 1. Running requests.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget,
                          self.max_model_len - 1 - req.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            blocks = kvm.allocate_slots(req, num_new)
            while blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                blocks = kvm.allocate_slots(req, num_new)
            if blocks is None:
                break
            scheduled_running.append(req)
            new_blocks_of[req.request_id] = blocks
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            i += 1

        # 2. Waiting requests (not in a step that had to preempt).
        skipped: deque[Request] = deque()
        # Blocks that requests already holding blocks (async loads in flight or
        # done) still need to finish; fresh admissions must leave them free, or a
        # later request could take them and nothing would run to free any.
        reserved = self._reserved_blocks()
        has_sync_loads = False
        # Set once a request could not get its blocks: fresh requests then wait their turn,
        # but requests already holding blocks (e.g. a finished async load) still run, on
        # the blocks reserved for them; otherwise one that cannot fit yet, in front of
        # them, would wait forever for blocks only they can free.
        out_of_blocks = False
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not self._finish_remote_load(req):
                    skipped.append(self.waiting.popleft())
                    continue
                if req.is_finished():  # failed by policy; _fail dequeued it
                    continue
            if out_of_blocks and req.num_computed_tokens == 0:
                skipped.append(self.waiting.popleft())
                continue
            if not kvm.can_ever_fit(req):
                self.waiting.popleft()
                self.stats.num_rejected += 1
                req.stop_reason = (
                    f"needs more KV blocks than the pool has ({kvm.block_pool.num_gpu_blocks - 1})"
                )
                logger.warning("rejecting request %s: %s", req.request_id, req.stop_reason)
                req.status = RequestStatus.FINISHED_ERROR
                self.stats.num_requests_failed += 1
                self._finished_out_of_band.append(req)
                self._free_request(req)
                continue

            computed_blocks = None
            num_local = 0
            num_external = num_claimed = 0
            load_async = False
            fresh = req.num_computed_tokens == 0
            if fresh:
                computed_blocks, num_local = kvm.get_computed_blocks(req)
                if self.connector is not None and req.request_id not in self._recompute_only:
                    ext, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
                    if ext is None:  # the connector has not decided yet: ask next step
                        skipped.append(self.waiting.popleft())
                        continue
                    num_claimed, num_external = _clamp_external(ext, req.num_tokens, num_local)
                    load_async = bool(load_async) and num_external > 0
            num_computed = (num_local + num_external) if fresh else req.num_computed_tokens
            num_new = 0 if load_async else min(req.num_tokens - num_computed, budget)
            own_need = 0 if fresh else self._remaining_need(req)

            blocks = kvm.allocate_slots(
                req,
                num_new,
                num_new_computed_tokens=num_local,
                new_computed_blocks=computed_blocks,
                # An async load fills every block it claimed before the request runs.
                num_external_computed_tokens=num_claimed if load_async else num_external,
                delay_cache_blocks=num_external > 0,
                full_sequence_must_fit=fresh,
                reserved_blocks=max(0, reserved - own_need),
            ) if (num_new > 0 or num_external > 0) else None
            if blocks is None:
                if not fresh and not self.running and not num_scheduled:
                    # It holds blocks but cannot grow and nothing runs that could
                    # free any: release its blocks (valid ones stay cached) and
                    # retry it from the prefix cache, like a preemption.
                    reserved -= own_need
                    kvm.free(req)
                    req.num_computed_tokens = 0
                    req.num_preemptions += 1
                    req.status = RequestStatus.PREEMPTED
                    self.stats.num_preemptions += 1
                    continue
                out_of_blocks = True  # admit only requests that already hold blocks
                skipped.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            reserved -= own_need

            if self.connector is not None and fresh:
                ok = self._call_update_state(req, num_claimed)
                if not ok and num_external > 0:
                    # The connector never planned the load: start over next step
                    # and compute those tokens instead.
                    kvm.free(req)
                    req.num_computed_tokens = 0
                    req.status = RequestStatus.WAITING
                    skipped.append(req)
                    continue
            if fresh:
                if req.request_id not in self._prompt_progress:  # first admission
                    self._prompt_progress[req.request_id] = 0
                    self.stats.num_prompt_tokens += req.num_prompt_tokens
                self._account(req, "gpu", 0, num_local)
            if load_async:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                req.num_computed_tokens = num_computed
                req.num_external_computed_tokens = num_external
                self._unplanned_async_loads.add(req.request_id)
                self._async_load_start[req.request_id] = num_local
                reserved += self._remaining_need(req)
                skipped.append(req)
                continue
            if num_external > 0:
                self._sync_load_reqs.add(req.request_id)
                req.num_external_computed_tokens = num_external
                has_sync_loads = True

            # "Resumed" means the worker already knows the request; one preempted
            # before it ever ran (e.g. after an async load) is new to the worker.
            was_preempted = req.request_id in self._sent_to_worker
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_computed
            self.running.append(req)
            (scheduled_resumed if was_preempted else scheduled_new).append(req)
            new_blocks_of[req.request_id] = blocks
            num_scheduled[req.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

        out = self._make_output(scheduled_new, scheduled_resumed, scheduled_running, new_blocks_of,
                                num_scheduled, preempted, has_sync_loads)
        # Advance now (as vLLM does): a failed load's valid computed tokens are
        # then num_computed_tokens - num_scheduled_tokens[req] for sync and async alike.
        for rid, n in num_scheduled.items():
            self.requests[rid].num_computed_tokens += n
        return out

    def _remaining_need(self, req: Request) -> int:
        """Blocks a waiting request that already holds blocks still needs (admission-capped).

        Counts what admission counts (:meth:`KVCacheManager.admission_tokens`).
        """
        full = self.kv_cache_manager.admission_tokens(req)
        coord = self.kv_cache_manager.coordinator
        return coord.get_num_blocks_to_allocate(
            req.request_id, full, self.kv_cache_manager.empty_kv_cache_blocks.blocks,
            req.num_computed_tokens, apply_admission_cap=True,
        )

    def _reserved_blocks(self) -> int:
        """Sum of :meth:`_remaining_need` over waiting requests that hold blocks."""
        return sum(self._remaining_need(r) for r in self.waiting if r.num_computed_tokens > 0)

    def _call_update_state(self, req: Request, num_external: int) -> bool:
        """Tell the connector about an admitted request; False if the hook raised."""
        assert self.connector is not None  # noqa: S101 - checked by the caller
        blocks = self.kv_cache_manager.get_blocks(req.request_id)
        return self.connector.update_state_after_alloc(req, blocks, num_external)

    def _make_output(self, new: list[Request], resumed: list[Request], running: list[Request],
                     new_blocks_of: dict[str, KVCacheBlocks], num_scheduled: dict[str, int],
                     preempted: list[Request], has_sync_loads: bool) -> SchedulerOutput:
        kvm = self.kv_cache_manager
        self._sent_to_worker.update(r.request_id for r in new)
        new_data = [
            NewRequestData(r.request_id, list(r.prompt_token_ids), kvm.get_block_ids(r.request_id),
                           r.num_computed_tokens)
            for r in new
        ]
        cached = CachedRequestData.make_empty()
        for r in resumed:
            cached.req_ids.append(r.request_id)
            cached.resumed_req_ids.add(r.request_id)
            cached.new_token_ids.append(list(r.all_token_ids))
            cached.new_block_ids.append(kvm.get_block_ids(r.request_id))
            cached.num_computed_tokens.append(r.num_computed_tokens)
            cached.num_output_tokens.append(r.num_output_tokens)
        for r in running:
            ids = new_blocks_of[r.request_id].get_block_ids()
            cached.req_ids.append(r.request_id)
            cached.new_token_ids.append([])
            cached.new_block_ids.append(ids if any(ids) else None)
            cached.num_computed_tokens.append(r.num_computed_tokens)
            cached.num_output_tokens.append(r.num_output_tokens)
        out = SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
            has_sync_kv_loads=has_sync_loads,
        )
        self.finished_req_ids = set()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
            self._step_async_loads = set()
            if out.kv_connector_metadata is not None:
                self._step_async_loads, self._unplanned_async_loads = self._unplanned_async_loads, set()
        return out

    # -- async loads -------------------------------------------------------------

    def _finish_remote_load(self, req: Request) -> bool:
        """Move a request whose async load was reported back to WAITING; False if not reported yet."""
        rid = req.request_id
        if rid not in self.finished_recving_kv_req_ids:
            return False
        self.finished_recving_kv_req_ids.discard(rid)
        kvm = self.kv_cache_manager
        if rid in self.failed_recving_kv_req_ids:
            self.failed_recving_kv_req_ids.discard(rid)
            if not self.recompute_on_failure:
                self._fail(req)
                return True
            self.stats.num_failed_loads_recovered += 1
            self._recompute_only.add(rid)
            # num_computed_tokens was already rolled back to the first invalid
            # block (or to the local hit when no block was named).
            if req.num_computed_tokens == 0:
                kvm.free(req)  # nothing valid: start over as a fresh request
            else:
                req.num_computed_tokens = kvm.rollback(req, req.num_computed_tokens)
            # The blocks before the first bad one were loaded and are used: only the rest
            # is recomputed.
            self._account(req, "connector", self._async_load_start.pop(rid, req.num_computed_tokens),
                          req.num_computed_tokens)
        else:
            self._async_load_start.pop(rid, None)
            self._account(req, "connector", req.num_computed_tokens - req.num_external_computed_tokens,
                          req.num_computed_tokens)
        kvm.cache_blocks(req, req.num_computed_tokens)
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        return True

    # -- applying the worker's report -------------------------------------------------

    def _requests_with_blocks(self, block_ids: set[int]) -> list[tuple[Request, int]]:
        """Requests holding any of ``block_ids``, with the token index of their first such block."""
        out = []
        managers = self.kv_cache_manager.coordinator.single_type_managers
        candidates = list(self.running) + [r for r in self.waiting
                                            if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        for req in candidates:
            first = None
            for m in managers:
                for idx, blk in enumerate(m.req_to_blocks.get(req.request_id, ())):
                    if blk.block_id in block_ids and not blk.is_null:
                        tok = idx * m.block_size
                        first = tok if first is None else min(first, tok)
                        break
            if first is not None:
                out.append((req, first))
        return out

    def _handle_invalid_blocks(self, invalid: set[int], num_scheduled: dict[str, int]) -> set[str]:
        """Roll back (or fail) every request that holds an invalid block; return the affected ids."""
        kvm = self.kv_cache_manager
        kvm.evict_blocks(invalid)
        affected: set[str] = set()
        for req, first_bad in self._requests_with_blocks(invalid):
            rid = req.request_id
            valid = min(first_bad, req.num_computed_tokens - num_scheduled.get(rid, 0))
            valid -= valid % self.block_size
            if valid >= req.num_computed_tokens:
                continue  # the bad block lies beyond what it computed: nothing to undo
            affected.add(rid)
            logger.warning("request %s: KV load failed at token %d; %s", rid, valid,
                           "recomputing" if self.recompute_on_failure else "failing the request")
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                req.num_computed_tokens = valid
                self.failed_recving_kv_req_ids.add(rid)
                continue
            if rid in self._sync_load_reqs:
                # This step's load is good up to the first bad block: count that part as
                # loaded (only the rest is recomputed).
                before = req.num_computed_tokens - num_scheduled.get(rid, 0)
                self._account(req, "connector", before - req.num_external_computed_tokens, valid)
            req.num_computed_tokens = kvm.rollback(req, valid)
            if self.recompute_on_failure:
                self.stats.num_failed_loads_recovered += 1
                self._recompute_only.add(rid)
            else:
                self._fail(req)
        return affected

    def _fail(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ERROR
        req.stop_reason = "KV load failed (load_failure_policy='fail')"
        self.stats.num_requests_failed += 1
        self._finished_out_of_band.append(req)
        self._free_request(req)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[Request]:
        """Apply one step's results; return the requests that finished in it."""
        kv_out = model_runner_output.kv_connector_output
        num_scheduled = scheduler_output.num_scheduled_tokens
        finished: list[Request] = []

        # 1. Invalid blocks: roll every holder back to its first invalid block.
        bad_reqs: set[str] = set()
        if kv_out is not None and kv_out.invalid_block_ids:
            bad_reqs = self._handle_invalid_blocks(set(kv_out.invalid_block_ids), num_scheduled)
        # 2. Failed async receives that named no block: recompute everything loaded.
        if kv_out is not None:
            failed_recving = set(kv_out.failed_recving)
            finished_recving = set(kv_out.finished_recving)
            if kv_out.loads_failed:
                # The step's loads may never have started, so the connector may never
                # report the async loads this step planned: they fail now (recomputed).
                started = {rid for rid in self._step_async_loads if rid in self.requests
                           and self.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS}
                failed_recving |= started
                finished_recving |= started
            for rid in failed_recving:
                req = self.requests.get(rid)
                if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                    continue
                if rid not in bad_reqs and rid not in self.failed_recving_kv_req_ids:
                    req.num_computed_tokens -= req.num_external_computed_tokens
                self.failed_recving_kv_req_ids.add(rid)

        # 3. Sampled tokens.
        for req in list(self.running):
            rid = req.request_id
            if rid not in num_scheduled:
                continue
            if rid in bad_reqs:
                continue  # this step's sample was computed on bad KV: dropped
            n = num_scheduled[rid]
            before = req.num_computed_tokens - n
            if rid in self._sync_load_reqs:
                self._account(req, "connector", before - req.num_external_computed_tokens, before)
            self._account(req, "computed", before, req.num_computed_tokens)
            sampled = model_runner_output.sampled_token_ids.get(rid)
            if not sampled:
                continue
            req.append_output_token_ids(sampled)
            if self._check_stop(req):
                self.running.remove(req)
                self._free_request(req)
                finished.append(req)
        # Sync-loaded blocks become visible only now that they are known good.
        for rid in self._sync_load_reqs:
            req = self.requests.get(rid)
            if req is not None and rid not in bad_reqs and not req.is_finished():
                self.kv_cache_manager.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens))
        self._sync_load_reqs.clear()

        # 4. The connector's finished transfers.
        if kv_out is not None:
            for rid in finished_recving:
                req = self.requests.get(rid)
                if req is None:
                    continue
                if req.is_finished():  # aborted while loading: free now (or after sending)
                    self._aborted_while_loading.discard(rid)
                    if rid in self._delay_free_after_load:
                        self._delay_free_after_load.discard(rid)
                        self.delayed_free[rid] = req
                    else:
                        self.kv_cache_manager.free(req)
                        self.requests.pop(rid, None)
                else:
                    self.finished_recving_kv_req_ids.add(rid)
            for rid in kv_out.finished_sending:
                req = self.delayed_free.pop(rid, None)
                if req is not None:
                    self.kv_cache_manager.free(req)
                    self.requests.pop(rid, None)
            self._worker_events.extend(kv_out.kv_cache_events)
            if self.connector is not None:
                self.connector.update_connector_output(kv_out, scheduler_output.kv_connector_metadata)
        if self._finished_out_of_band:
            finished = self._finished_out_of_band + finished
            self._finished_out_of_band = []
        return finished

    def _check_stop(self, req: Request) -> bool:
        if req.eos_token_id is not None and req.output_token_ids and req.output_token_ids[-1] == req.eos_token_id:
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _free_request(self, req: Request, keep_blocks: bool = False) -> None:
        """Tell the connector, then free the blocks now or once the connector has sent them.

        With ``keep_blocks`` (aborted during a load) the blocks stay until the
        load is reported finished.
        """
        rid = req.request_id
        delay = False
        if self.connector is not None:
            block_ids = self.kv_cache_manager.get_block_ids(rid)
            delay, params = self.connector.request_finished(req, block_ids[0] if block_ids else [])
            req.kv_transfer_params = params
        self.finished_req_ids.add(rid)
        self._recompute_only.discard(rid)
        self._async_load_start.pop(rid, None)
        self._prompt_progress.pop(rid, None)
        self._sent_to_worker.discard(rid)
        if keep_blocks:
            if delay:
                self._delay_free_after_load.add(rid)
            return  # freed when the connector reports the load finished
        if delay:
            self.delayed_free[rid] = req
        else:
            self.kv_cache_manager.free(req)
            self.requests.pop(rid, None)

    def take_events(self) -> list[KVCacheEvent]:
        """Block-pool events, then the connector's (scheduler side, then worker side), since the last call."""
        events = self.kv_cache_manager.take_events()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        if self._worker_events:
            events.extend(self._worker_events)
            self._worker_events = []
        return events
