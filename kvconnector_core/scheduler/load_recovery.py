"""Load-failure recovery: invalid blocks roll their holders back, failed async loads recompute.

A request whose load failed is rolled back to its first invalid block (or to its local hit
when no block was named) and recomputes from there, or is failed under
``load_failure_policy="fail"``; it never asks the connector again
(:attr:`RequestState.recompute_only`).

Primitives:

- :class:`LoadRecovery` -- tracks which connector plan carries each async load, applies the
  worker's reports of failed loads and invalid blocks, and settles reported async loads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from kvconnector_core.connector.metadata import KVConnectorOutput
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheManager
from kvconnector_core.request import Request, RequestStatus
from kvconnector_core.scheduler.request_state import RequestState
from kvconnector_core.scheduler.stats import SchedulerStats

__all__ = ["LOAD_FAILED", "LoadRecovery"]

logger = logging.getLogger(__name__)

LOAD_FAILED = "KV load failed (load_failure_policy='fail')"
"""The stop reason of a request failed by ``load_failure_policy="fail"``."""


class LoadRecovery:
    """Recovers requests whose KV load failed, under one load-failure policy.

    Args:
        kv_cache_manager: the scheduler's KV cache manager.
        states: the scheduler's request records by id (read live).
        stats: the scheduler's counters.
        block_size: the block size the scheduler aligns to.
        recompute: recompute a failed load (True) or fail its request (False).
        fail: finishes a request with an error and the given reason (the scheduler's).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, states: Mapping[str, RequestState],
                 stats: SchedulerStats, *, block_size: int, recompute: bool,
                 fail: Callable[[Request, str], None]) -> None:
        self._kvm = kv_cache_manager
        self._states = states
        self._stats = stats
        self._block_size = block_size
        self._recompute = recompute
        self._fail = fail
        # Connector plans built so far (a step whose plan is None built none), and the
        # number of the latest step's plan (None when that step built none).
        self._plans_built = 0
        self._step_plan: int | None = None

    # -- async loads in flight ----------------------------------------------------

    def start_async_load(self, state: RequestState, start: int) -> None:
        """Note an async load put in flight from token ``start``; the next plan built carries it."""
        state.async_load_start = start
        state.load_plan = self._plans_built + 1

    def plan_built(self, carried: bool) -> None:
        """Note the step's connector plan: ``carried`` when one was built (not None)."""
        if carried:
            self._plans_built += 1
            self._step_plan = self._plans_built
        else:
            self._step_plan = None

    def _loads_of_step(self) -> set[str]:
        """Async loads the latest step's plan carried that are still in flight."""
        plan = self._step_plan
        if plan is None:
            return set()
        return {rid for rid, st in self._states.items() if st.load_plan == plan
                and st.request.status == RequestStatus.WAITING_FOR_REMOTE_KVS}

    def note_failed_loads(self, kv_out: KVConnectorOutput, bad_reqs: set[str]) -> set[str]:
        """Roll back async loads the worker reports failed; return the loads reported finished.

        Failed loads that named no block recompute everything loaded (those that named one
        were rolled back by :meth:`handle_invalid_blocks`, listed in ``bad_reqs``).
        """
        failed_recving = set(kv_out.failed_recving)
        finished_recving = set(kv_out.finished_recving)
        if kv_out.loads_failed:
            # The step's loads may never have started, so the connector may never
            # report the async loads this step planned: they fail now (recomputed).
            started = self._loads_of_step()
            failed_recving |= started
            finished_recving |= started
        for rid in failed_recving:
            state = self._states.get(rid)
            if state is None or state.request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            if rid not in bad_reqs and not state.load_failed:
                state.request.num_computed_tokens -= state.request.num_external_computed_tokens
            state.load_failed = True
        return finished_recving

    def finish_remote_load(self, state: RequestState) -> bool:
        """Move a request whose async load was reported back to WAITING; False if not reported.

        A failed load is recomputed (or its request failed, by policy); a good one is counted
        and its blocks become visible in the prefix cache.
        """
        if not state.load_reported:
            return False
        state.load_reported = False
        req = state.request
        if state.load_failed:
            state.load_failed = False
            if not self._recompute:
                self._fail(req, LOAD_FAILED)
                return True
            self._recover_async(state)
        else:
            state.async_load_start = None
            state.count_prompt(self._stats, "connector",
                               req.num_computed_tokens - req.num_external_computed_tokens,
                               req.num_computed_tokens)
        self._kvm.cache_blocks(req, req.num_computed_tokens)
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        return True

    def _recover_async(self, state: RequestState) -> None:
        req = state.request
        self._stats.num_failed_loads_recovered += 1
        state.recompute_only = True
        # num_computed_tokens was already rolled back to the first invalid
        # block (or to the local hit when no block was named).
        if req.num_computed_tokens == 0:
            self._kvm.free(req)  # nothing valid: start over as a fresh request
        else:
            req.num_computed_tokens = self._kvm.rollback(req, req.num_computed_tokens)
        # The blocks before the first bad one were loaded and are used: only the rest
        # is recomputed.
        start = state.async_load_start
        state.async_load_start = None
        state.count_prompt(self._stats, "connector",
                           req.num_computed_tokens if start is None else start,
                           req.num_computed_tokens)

    # -- invalid blocks -----------------------------------------------------------

    def handle_invalid_blocks(self, invalid: set[int], num_scheduled: Mapping[str, int],
                              candidates: Iterable[Request]) -> set[str]:
        """Roll back (or fail) every candidate holding an invalid block; return the affected ids.

        Args:
            invalid: the block ids the worker reported invalid.
            num_scheduled: the step's scheduled tokens per request id.
            candidates: the requests that may hold blocks (running, and those loading).
        """
        self._kvm.evict_blocks(invalid)
        affected: set[str] = set()
        for req, first_bad in self._holders(invalid, candidates):
            if self._roll_back(req, first_bad, num_scheduled.get(req.request_id, 0)):
                affected.add(req.request_id)
        return affected

    def _holders(self, block_ids: set[int],
                 candidates: Iterable[Request]) -> list[tuple[Request, int]]:
        """Candidates holding any of ``block_ids``, with the token index of their first one."""
        out = []
        managers = self._kvm.coordinator.single_type_managers
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

    def _roll_back(self, req: Request, first_bad: int, num_scheduled: int) -> bool:
        """Roll ``req`` back before its first bad token; False if that undoes nothing."""
        rid = req.request_id
        state = self._states[rid]
        valid = min(first_bad, req.num_computed_tokens - num_scheduled)
        valid -= valid % self._block_size
        if valid >= req.num_computed_tokens:
            return False  # the bad block lies beyond what it computed: nothing to undo
        logger.warning("request %s: KV load failed at token %d; %s", rid, valid,
                       "recomputing" if self._recompute else "failing the request")
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            req.num_computed_tokens = valid
            state.load_failed = True
            return True
        if state.sync_load:
            # This step's load is good up to the first bad block: count that part as
            # loaded (only the rest is recomputed).
            before = req.num_computed_tokens - num_scheduled
            state.count_prompt(self._stats, "connector",
                               before - req.num_external_computed_tokens, valid)
        req.num_computed_tokens = self._kvm.rollback(req, valid)
        if self._recompute:
            self._stats.num_failed_loads_recovered += 1
            state.recompute_only = True
        else:
            self._fail(req, LOAD_FAILED)
        return True
