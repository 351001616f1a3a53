"""Load-failure recovery: invalid blocks roll their holders back, failed async loads recompute.

A request whose load failed is rolled back to its first invalid block (or to its local hit
when no block was named) and recomputes from there, or is failed under
``load_failure_policy="fail"``; it never asks the connector again (``_recompute_only``).
"""

from __future__ import annotations

import logging

from kvconnector_core.kv_cache.kv_cache_manager import KVCacheManager
from kvconnector_core.request import Request, RequestStatus
from kvconnector_core.scheduler._accounting import _Accounting
from kvconnector_core.scheduler._finishing import _Finishing

# The scheduler's logger, as before the split (log filters and tests name it).
logger = logging.getLogger("kvconnector_core.scheduler.scheduler")


class _LoadRecovery(_Accounting, _Finishing):
    """Scheduler mixin: finishing async loads and recovering from failed ones."""

    kv_cache_manager: KVCacheManager
    recompute_on_failure: bool
    block_size: int
    _sync_load_reqs: set[str]

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

