"""How requests leave the scheduler: aborted, failed, stopped, and their blocks freed.

Blocks are freed at once, or kept until the connector reports them sent (``request_finished``
asked to delay the free) or until a load in flight on them is reported finished.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from kvconnector_core.connector.guard import GuardedScheduler
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheManager
from kvconnector_core.request import Request, RequestStatus
from kvconnector_core.scheduler._accounting import SchedulerStats


class _Finishing:
    """Scheduler mixin: finishing requests and freeing (or holding) their blocks."""

    kv_cache_manager: KVCacheManager
    connector: GuardedScheduler | None
    stats: SchedulerStats
    max_model_len: int
    requests: dict[str, Request]
    waiting: deque[Request]
    running: list[Request]
    finished_req_ids: set[str]
    delayed_free: dict[str, Request]
    finished_recving_kv_req_ids: set[str]
    failed_recving_kv_req_ids: set[str]
    _finished_out_of_band: list[Request]
    _aborted_while_loading: set[str]
    _recompute_only: set[str]
    _prompt_progress: dict[str, int]
    _sent_to_worker: set[str]
    _async_load_start: dict[str, int]
    _delay_free_after_load: set[str]

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
