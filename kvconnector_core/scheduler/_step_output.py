"""The scheduler's step I/O: building the step's SchedulerOutput, applying the worker's report."""

from __future__ import annotations

from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
from kvconnector_core.kv_events import KVCacheEvent
from kvconnector_core.request import Request, RequestStatus
from kvconnector_core.scheduler._load_recovery import _LoadRecovery
from kvconnector_core.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


class _StepOutput(_LoadRecovery):
    """Scheduler mixin: the plan sent to the worker and the report that comes back."""

    _worker_events: list[KVCacheEvent]
    _step_async_loads: set[str]
    _unplanned_async_loads: set[str]

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
