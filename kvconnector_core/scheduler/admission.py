"""Admission of waiting requests, in arrival order, under one step's budget.

For each waiting request admission asks the KV cache manager for the local prefix hit,
asks the connector how many more tokens it can load (``get_num_new_matched_tokens``),
checks with the admission caps that the whole sequence fits, allocates, and tells the
connector (``update_state_after_alloc``). A request whose load is async waits for it,
holding its blocks; blocks such requests still need are reserved from fresh admissions.

Primitives:

- :class:`Admission` -- admits waiting requests and returns what it admitted.
- :class:`Admitted` -- the record of one admission pass.
- :func:`requeue_for_recompute` -- frees a request's blocks so it starts over from the
  prefix cache (preemption by recompute).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvconnector_core.connector.guard import GuardedScheduler
from kvconnector_core.errors import InvariantError
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvconnector_core.request import Request, RequestStatus
from kvconnector_core.scheduler.load_recovery import LoadRecovery
from kvconnector_core.scheduler.request_state import RequestState
from kvconnector_core.scheduler.stats import SchedulerStats

__all__ = ["Admission", "Admitted", "requeue_for_recompute"]

logger = logging.getLogger(__name__)


def requeue_for_recompute(req: Request, kv_cache_manager: KVCacheManager,
                          stats: SchedulerStats) -> None:
    """Free ``req``'s blocks (valid ones stay cached) and mark it preempted, to recompute."""
    kv_cache_manager.free(req)
    req.status = RequestStatus.PREEMPTED
    req.num_computed_tokens = 0
    req.num_preemptions += 1
    stats.num_preemptions += 1


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


@dataclass(slots=True)
class Admitted:
    """What one admission pass admitted to run this step.

    Attributes:
        new: requests the worker has not been sent yet.
        resumed: requests the worker knows (preempted after it was sent them).
        order: every admitted request, in admission order (they join the running ones).
        num_scheduled: per admitted request id, the tokens it computes this step.
        has_sync_loads: some admitted request loads KV synchronously this step.
    """

    new: list[Request] = field(default_factory=list)
    resumed: list[Request] = field(default_factory=list)
    order: list[Request] = field(default_factory=list)
    num_scheduled: dict[str, int] = field(default_factory=dict)
    has_sync_loads: bool = False


@dataclass(slots=True)
class _Match:
    """A fresh request's prefix hit: local blocks, and what the connector loads."""

    computed_blocks: KVCacheBlocks | None = None
    num_local: int = 0
    num_claimed: int = 0  # tokens the connector was told it loads
    num_external: int = 0  # tokens counted as computed by the load
    load_async: bool = False


@dataclass(slots=True)
class _Pass:
    """The running totals of one admission pass."""

    budget: int
    seats: int  # requests that may still join the running ones
    # Blocks that requests already holding blocks (async loads in flight or done) still
    # need to finish; fresh admissions must leave them free, or a later request could
    # take them and nothing would run to free any.
    reserved: int
    # Nothing runs or was scheduled this step (so nothing will free blocks).
    idle: bool
    # Set once a request could not get its blocks: fresh requests then wait their turn,
    # but requests already holding blocks (e.g. a finished async load) still run, on the
    # blocks reserved for them; otherwise one that cannot fit yet, in front of them,
    # would wait forever for blocks only they can free.
    out_of_blocks: bool = False
    skipped: deque[Request] = field(default_factory=deque)
    admitted: Admitted = field(default_factory=Admitted)


class Admission:
    """Admits waiting requests: prefix hits, connector loads, allocation, the connector's hook.

    Args:
        kv_cache_manager: the scheduler's KV cache manager.
        connector: the scheduler-side connector behind its guard, or None.
        states: the scheduler's request records by id (read live).
        stats: the scheduler's counters.
        recovery: settles async loads the connector reported.
        max_num_seqs: most requests running at once.
        fail: finishes a request with an error and the given reason (the scheduler's).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, connector: GuardedScheduler | None,
                 states: Mapping[str, RequestState], stats: SchedulerStats,
                 recovery: LoadRecovery, *, max_num_seqs: int,
                 fail: Callable[[Request, str], None]) -> None:
        self._kvm = kv_cache_manager
        self._connector = connector
        self._states = states
        self._stats = stats
        self._recovery = recovery
        self._max_num_seqs = max_num_seqs
        self._fail = fail

    def admit(self, waiting: deque[Request], *, budget: int, num_running: int,
              anything_scheduled: bool) -> Admitted:
        """Admit waiting requests in order while the budget and the seats last.

        Requests that cannot run yet (their load in flight, no blocks, the connector
        undecided) keep their place in ``waiting``; admitted ones leave it.

        Args:
            waiting: the waiting queue (changed in place).
            budget: tokens left in the step's budget.
            num_running: requests running before admission.
            anything_scheduled: the step already scheduled a running request.

        Returns:
            What was admitted.
        """
        p = _Pass(budget=budget, seats=self._max_num_seqs - num_running,
                  reserved=self._reserved_blocks(waiting),
                  idle=num_running == 0 and not anything_scheduled)
        loading = RequestStatus.WAITING_FOR_REMOTE_KVS
        while waiting and p.budget > 0 and p.seats > 0:
            req = waiting[0]
            # Inline fast path for the common case of a long queue behind a full pool.
            if p.out_of_blocks and req.num_computed_tokens == 0 and req.status != loading:
                p.skipped.append(waiting.popleft())
            elif self._ready(req, p, waiting):
                self._admit_one(self._states[req.request_id], p, waiting)
        waiting.extendleft(reversed(p.skipped))
        return p.admitted

    def _ready(self, req: Request, p: _Pass, waiting: deque[Request]) -> bool:
        """Whether the head of ``waiting`` may try admission now; if not, it was set aside."""
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if not self._recovery.finish_remote_load(self._states[req.request_id]):
                p.skipped.append(waiting.popleft())
                return False
            if req.is_finished():  # failed by policy: no longer waiting
                return False
        if p.out_of_blocks and req.num_computed_tokens == 0:
            p.skipped.append(waiting.popleft())
            return False
        if not self._kvm.can_ever_fit(req):
            waiting.popleft()
            self._stats.num_rejected += 1
            num_usable = self._kvm.block_pool.num_gpu_blocks - 1
            reason = f"needs more KV blocks than the pool has ({num_usable})"
            logger.warning("rejecting request %s: %s", req.request_id, reason)
            self._fail(req, reason)
            return False
        return True

    def _admit_one(self, state: RequestState, p: _Pass, waiting: deque[Request]) -> None:
        """Allocate for the head of ``waiting``: admit it, start its async load, or set it aside."""
        req = state.request
        fresh = req.num_computed_tokens == 0
        match = self._match(state) if fresh else _Match()
        if match is None:  # the connector has not decided yet: ask next step
            p.skipped.append(waiting.popleft())
            return
        num_computed = (match.num_local + match.num_external) if fresh else req.num_computed_tokens
        num_new = 0 if match.load_async else min(req.num_tokens - num_computed, p.budget)
        own_need = 0 if fresh else self._remaining_need(req)
        if num_new == 0 and match.num_external == 0:  # hits and loads leave a token to compute
            raise InvariantError(f"request {req.request_id!r} has nothing to compute or load at "
                                 f"admission (num_tokens={req.num_tokens}, "
                                 f"num_computed_tokens={num_computed})")
        blocks = self._kvm.allocate_slots(
            req,
            num_new,
            num_new_computed_tokens=match.num_local,
            new_computed_blocks=match.computed_blocks,
            # An async load fills every block it claimed before the request runs.
            num_external_computed_tokens=(match.num_claimed if match.load_async
                                          else match.num_external),
            delay_cache_blocks=match.num_external > 0,
            full_sequence_must_fit=fresh,
            reserved_blocks=max(0, p.reserved - own_need),
        )
        if blocks is None:
            self._no_blocks(req, p, waiting, own_need, fresh)
            return
        waiting.popleft()
        p.reserved -= own_need
        if fresh and not self._settle_fresh(state, match):
            p.skipped.append(req)
        elif match.load_async:
            self._start_async_load(state, match, num_computed, p)
        else:
            self._run(state, match, num_computed, num_new, p)

    def _match(self, state: RequestState) -> _Match | None:
        """A fresh request's local hit and connector load; None while the connector is undecided."""
        req = state.request
        computed_blocks, num_local = self._kvm.get_computed_blocks(req)
        if self._connector is None or state.recompute_only:
            return _Match(computed_blocks, num_local)
        ext, load_async = self._connector.get_num_new_matched_tokens(req, num_local)
        if ext is None:
            return None
        num_claimed, num_external = _clamp_external(ext, req.num_tokens, num_local)
        return _Match(computed_blocks, num_local, num_claimed, num_external,
                      bool(load_async) and num_external > 0)

    def _no_blocks(self, req: Request, p: _Pass, waiting: deque[Request], own_need: int,
                   fresh: bool) -> None:
        if not fresh and p.idle:
            # It holds blocks but cannot grow and nothing runs that could free any:
            # release its blocks (valid ones stay cached) and retry it from the prefix
            # cache, like a preemption; it stays at the head of the queue.
            p.reserved -= own_need
            requeue_for_recompute(req, self._kvm, self._stats)
            return
        p.out_of_blocks = True  # admit only requests that already hold blocks
        p.skipped.append(waiting.popleft())

    def _settle_fresh(self, state: RequestState, match: _Match) -> bool:
        """Tell the connector and count the prompt; False if the planned load is off."""
        req = state.request
        if self._connector is not None:
            blocks = self._kvm.get_blocks(req.request_id)
            ok = self._connector.update_state_after_alloc(req, blocks, match.num_claimed)
            if not ok and match.num_external > 0:
                # The connector never planned the load: start over next step and
                # compute those tokens instead.
                self._kvm.free(req)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
                return False
        if state.prompt_progress is None:  # first admission
            state.prompt_progress = 0
            self._stats.num_prompt_tokens += req.num_prompt_tokens
        state.count_prompt(self._stats, "gpu", 0, match.num_local)
        return True

    def _start_async_load(self, state: RequestState, match: _Match, num_computed: int,
                          p: _Pass) -> None:
        req = state.request
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.num_computed_tokens = num_computed
        req.num_external_computed_tokens = match.num_external
        self._recovery.start_async_load(state, match.num_local)
        p.reserved += self._remaining_need(req)
        p.skipped.append(req)

    def _run(self, state: RequestState, match: _Match, num_computed: int, num_new: int,
             p: _Pass) -> None:
        req = state.request
        admitted = p.admitted
        if match.num_external > 0:
            state.sync_load = True
            req.num_external_computed_tokens = match.num_external
            admitted.has_sync_loads = True
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        admitted.order.append(req)
        # "Resumed" means the worker already knows the request; one preempted before it
        # ever ran (e.g. after an async load) is new to the worker.
        (admitted.resumed if state.sent_to_worker else admitted.new).append(req)
        admitted.num_scheduled[req.request_id] = num_new
        p.budget -= num_new
        p.seats -= 1
        p.idle = False

    def _remaining_need(self, req: Request) -> int:
        """Blocks a waiting request that already holds blocks still needs (admission-capped).

        Counts what admission counts (:meth:`KVCacheManager.admission_tokens`).
        """
        full = self._kvm.admission_tokens(req)
        return self._kvm.coordinator.get_num_blocks_to_allocate(
            req.request_id, full, self._kvm.empty_kv_cache_blocks.blocks,
            req.num_computed_tokens, apply_admission_cap=True,
        )

    def _reserved_blocks(self, waiting: deque[Request]) -> int:
        """Sum of :meth:`_remaining_need` over waiting requests that hold blocks."""
        return sum(self._remaining_need(r) for r in waiting if r.num_computed_tokens > 0)
