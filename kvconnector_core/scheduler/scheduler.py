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
from typing import TYPE_CHECKING

from kvconnector_core.connector.guard import GuardedScheduler
from kvconnector_core.errors import ConfigError, InvariantError
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
from kvconnector_core.kv_events import KVCacheEvent
from kvconnector_core.request import Request, RequestStatus
from kvconnector_core.scheduler._accounting import SchedulerStats
from kvconnector_core.scheduler._admission import _Admission, _clamp_external
from kvconnector_core.scheduler._step_output import _StepOutput
from kvconnector_core.scheduler.output import SchedulerOutput

if TYPE_CHECKING:
    from kvconnector_core.connector.base import KVConnectorBase_V1

__all__ = ["LOAD_FAILURE_POLICIES", "Scheduler", "SchedulerStats"]

logger = logging.getLogger(__name__)

LOAD_FAILURE_POLICIES = ("recompute", "fail")
"""What to do with a request whose KV load failed: recompute from the first bad block, or fail it."""


class Scheduler(_StepOutput, _Admission):
    """Plans engine steps and keeps requests, blocks and the connector in sync.

    The connector-facing parts live in private mixins beside this module: token accounting
    (``_accounting``), admission helpers (``_admission``), finishing requests
    (``_finishing``), load-failure recovery (``_load_recovery``) and the step's output and
    the worker's report (``_step_output``).

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


    # -- scheduling ------------------------------------------------------------

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)


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
            if num_new == 0 and num_external == 0:  # unreachable: hits and loads leave a token to compute
                raise InvariantError(f"request {req.request_id!r} has nothing to compute or load at admission "
                                     f"(num_tokens={req.num_tokens}, num_computed_tokens={num_computed})")

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
            )
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

    def take_events(self) -> list[KVCacheEvent]:
        """Block-pool events, then the connector's (scheduler side, then worker side), since the last call."""
        events = self.kv_cache_manager.take_events()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        if self._worker_events:
            events.extend(self._worker_events)
            self._worker_events = []
        return events
