"""Continuous-batching scheduler with connector hooks and load-failure recovery.

One :meth:`Scheduler.schedule` call plans a step under a token budget: running
requests first (decode or the next prefill chunk; preempting the newest running
request by recompute when blocks run out), then waiting requests in arrival
order (:class:`~kvconnector_core.scheduler.admission.Admission`). The plan ends
with ``build_connector_meta``.

:meth:`Scheduler.update_from_output` applies the worker's report: invalid
blocks first (roll the affected requests back to their first invalid block, or
fail them; :class:`~kvconnector_core.scheduler.load_recovery.LoadRecovery`),
then sampled tokens, then the connector's finished transfers.

Failure contract: the connector is called only through a
:class:`~kvconnector_core.connector.guard.GuardedScheduler`, which contains what a hook
raises (see ``docs/failure-contract.md``); blocks written by a connector load become
visible in the prefix cache only after the load is known to have succeeded.

Primitives:

- :class:`Scheduler` -- plans engine steps and keeps requests, blocks and the connector in sync.
- :data:`LOAD_FAILURE_POLICIES` -- the valid ``load_failure_policy`` values.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvconnector_core.connector.config import LOAD_FAILURE_POLICIES
from kvconnector_core.connector.guard import GuardedScheduler
from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
from kvconnector_core.kv_events import KVCacheEvent
from kvconnector_core.request import Request, RequestStatus
from kvconnector_core.scheduler.admission import Admission, Admitted, requeue_for_recompute
from kvconnector_core.scheduler.load_recovery import LoadRecovery
from kvconnector_core.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvconnector_core.scheduler.request_state import RequestState, RequestsView
from kvconnector_core.scheduler.stats import SchedulerStats

if TYPE_CHECKING:
    from kvconnector_core.connector.base import KVConnectorBase_V1
    from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorOutput

__all__ = ["LOAD_FAILURE_POLICIES", "Scheduler"]

"""What to do with a request whose KV load failed: recompute from its first bad block, or fail."""


def _check_config(load_failure_policy: str, max_num_batched_tokens: int, max_num_seqs: int,
                  max_model_len: int) -> None:
    if load_failure_policy not in LOAD_FAILURE_POLICIES:
        raise ConfigError(f"load_failure_policy={load_failure_policy!r}; "
                          f"valid: {', '.join(LOAD_FAILURE_POLICIES)}")
    if max_num_batched_tokens < 1 or max_num_seqs < 1 or max_model_len < 2:
        raise ConfigError(
            f"max_num_batched_tokens={max_num_batched_tokens}, max_num_seqs={max_num_seqs}, "
            f"max_model_len={max_model_len}; need >= 1, >= 1 and >= 2"
        )


@dataclass(slots=True)
class _RunningStep:
    """The running requests one step schedules, and those it preempted to do so."""

    budget: int
    scheduled: list[Request] = field(default_factory=list)
    new_blocks_of: dict[str, KVCacheBlocks] = field(default_factory=dict)
    num_scheduled: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    """Plans engine steps and keeps requests, blocks and the connector in sync.

    It owns the KV cache manager, the guarded connector, an
    :class:`~kvconnector_core.scheduler.admission.Admission` for waiting requests and a
    :class:`~kvconnector_core.scheduler.load_recovery.LoadRecovery` for failed loads, and
    one :class:`~kvconnector_core.scheduler.request_state.RequestState` per tracked request.

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
        _check_config(load_failure_policy, max_num_batched_tokens, max_num_seqs, max_model_len)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.hash_block_size = hash_block_size
        self.recompute_on_failure = load_failure_policy == "recompute"
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config, max_model_len, max_num_batched_tokens,
            scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
            enable_caching=enable_prefix_caching, enable_kv_cache_events=enable_kv_cache_events,
            reserve_full_output=reserve_full_output,
        )
        self.block_size = scheduler_block_size
        self.stats = SchedulerStats()
        self.connector: GuardedScheduler | None = None
        """The scheduler-side connector behind its guard, or None."""
        if connector is not None:
            self.connector = GuardedScheduler(connector, errors=self.stats.connector_errors)
        # Every request from add_request until its blocks are freed, even once finished.
        self._states: dict[str, RequestState] = {}
        self.requests = RequestsView(self._states)
        """The tracked requests by id (read-only): waiting, running, finished with blocks held."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.delayed_free: dict[str, Request] = {}
        """Finished requests whose blocks are kept until the connector reports them sent."""
        self._worker_events: list[KVCacheEvent] = []
        # Requests finished outside update_from_output's token loop (rejected,
        # failed by policy); reported by the next update_from_output.
        self._finished_out_of_band: list[Request] = []
        self._recovery = LoadRecovery(self.kv_cache_manager, self._states, self.stats,
                                      block_size=scheduler_block_size,
                                      recompute=self.recompute_on_failure, fail=self._fail)
        self._admission = Admission(self.kv_cache_manager, self.connector, self._states,
                                    self.stats, self._recovery, max_num_seqs=max_num_seqs,
                                    fail=self._fail)
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
        rid = request.request_id
        if rid in self._states:
            raise ConfigError(f"request id {rid!r} is already in use")
        if request.hash_block_size != self.hash_block_size:
            raise ConfigError(
                f"request {rid!r} hashes blocks of {request.hash_block_size} tokens; "
                f"the scheduler needs hash_block_size={self.hash_block_size}"
            )
        if request.num_prompt_tokens >= self.max_model_len:
            raise ConfigError(
                f"request {rid!r} has {request.num_prompt_tokens} prompt tokens; "
                f"max_model_len={self.max_model_len} allows at most {self.max_model_len - 1}"
            )
        self._states[rid] = RequestState(request)
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        """Whether any request still waits, runs, has blocks held for the connector, or
        finished since the last step.

        The last case makes the engine run one empty step after a finish (as vLLM
        does), so the worker learns ``finished_req_ids`` and connectors meet empty
        steps in kvconnector's engine too. A connector with pending work (a report the
        guard redelivers, a message for its worker side) also keeps the engine stepping.
        """
        # Every tracked request waits, runs, or holds blocks (kept for a send or a load).
        return bool(self._states or self.finished_req_ids
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

    def take_events(self) -> list[KVCacheEvent]:
        """Block-pool events, then the connector's (scheduler side, then worker side),
        since the last call."""
        events = self.kv_cache_manager.take_events()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        if self._worker_events:
            events.extend(self._worker_events)
            self._worker_events = []
        return events

    # -- scheduling ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step; see the module docstring for the order of work."""
        self.stats.num_steps += 1
        run = self._schedule_running()
        if run.preempted:  # a step that had to preempt admits nothing
            admitted = Admitted()
        else:
            admitted = self._admission.admit(self.waiting, budget=run.budget,
                                             num_running=len(self.running),
                                             anything_scheduled=bool(run.num_scheduled))
            self.running.extend(admitted.order)
        out = self._make_output(run, admitted)
        # Advance now (as vLLM does): a failed load's valid computed tokens are
        # then num_computed_tokens - num_scheduled_tokens[req] for sync and async alike.
        states = self._states
        for rid, n in out.num_scheduled_tokens.items():
            states[rid].request.num_computed_tokens += n
        return out

    def _schedule_running(self) -> _RunningStep:
        """Schedule running requests in order, preempting the newest when blocks run out."""
        run = _RunningStep(budget=self.max_num_batched_tokens)
        running = self.running
        i = 0
        while i < len(running) and run.budget > 0:
            req = running[i]
            i += 1
            num_new = min(req.num_tokens - req.num_computed_tokens, run.budget,
                          self.max_model_len - 1 - req.num_computed_tokens)
            if num_new <= 0:
                continue
            blocks = self._allocate_or_preempt(req, num_new, run.preempted)
            if blocks is None:
                break
            run.scheduled.append(req)
            run.new_blocks_of[req.request_id] = blocks
            run.num_scheduled[req.request_id] = num_new
            run.budget -= num_new
        return run

    def _allocate_or_preempt(self, req: Request, num_new: int,
                             preempted: list[Request]) -> KVCacheBlocks | None:
        """Blocks for ``num_new`` tokens of ``req``, preempting from the tail of the running
        ones until they fit; None once ``req`` itself was preempted."""
        kvm = self.kv_cache_manager
        blocks = kvm.allocate_slots(req, num_new)
        while blocks is None:
            victim = self.running.pop()
            requeue_for_recompute(victim, kvm, self.stats)
            self.waiting.appendleft(victim)
            preempted.append(victim)
            if victim is req:
                return None
            blocks = kvm.allocate_slots(req, num_new)
        return blocks

    def _make_output(self, run: _RunningStep, admitted: Admitted) -> SchedulerOutput:
        """The step's plan for the worker, with the connector's metadata."""
        kvm = self.kv_cache_manager
        for r in admitted.new:
            self._states[r.request_id].sent_to_worker = True
        new_data = [
            NewRequestData(r.request_id, list(r.prompt_token_ids), kvm.get_block_ids(r.request_id),
                           r.num_computed_tokens)
            for r in admitted.new
        ]
        num_scheduled = {**run.num_scheduled, **admitted.num_scheduled}
        out = SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=self._cached_data(admitted.resumed, run),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in run.preempted},
            has_sync_kv_loads=admitted.has_sync_loads,
        )
        self.finished_req_ids = set()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
            self._recovery.plan_built(out.kv_connector_metadata is not None)
        return out

    def _cached_data(self, resumed: list[Request], run: _RunningStep) -> CachedRequestData:
        """Resumed requests (all their tokens and blocks), then running ones (new blocks)."""
        kvm = self.kv_cache_manager
        cached = CachedRequestData.make_empty()
        for r in resumed:
            cached.req_ids.append(r.request_id)
            cached.resumed_req_ids.add(r.request_id)
            cached.new_token_ids.append(list(r.all_token_ids))
            cached.new_block_ids.append(kvm.get_block_ids(r.request_id))
            cached.num_computed_tokens.append(r.num_computed_tokens)
            cached.num_output_tokens.append(r.num_output_tokens)
        for r in run.scheduled:
            ids = run.new_blocks_of[r.request_id].get_block_ids()
            cached.req_ids.append(r.request_id)
            cached.new_token_ids.append([])
            cached.new_block_ids.append(ids if any(ids) else None)
            cached.num_computed_tokens.append(r.num_computed_tokens)
            cached.num_output_tokens.append(r.num_output_tokens)
        return cached

    # -- the worker's report ---------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[Request]:
        """Apply one step's results; return the requests that finished in it."""
        kv_out = model_runner_output.kv_connector_output
        num_scheduled = scheduler_output.num_scheduled_tokens
        bad_reqs: set[str] = set()
        finished_recving: set[str] = set()
        if kv_out is not None:
            # Invalid blocks first: roll every holder back to its first invalid block.
            if kv_out.invalid_block_ids:
                bad_reqs = self._recovery.handle_invalid_blocks(
                    set(kv_out.invalid_block_ids), num_scheduled, self._block_holders())
            finished_recving = self._recovery.note_failed_loads(kv_out, bad_reqs)
        finished = self._apply_sampled_tokens(model_runner_output.sampled_token_ids,
                                              num_scheduled, bad_reqs)
        if kv_out is not None:
            self._apply_transfers(kv_out, finished_recving, scheduler_output.kv_connector_metadata)
        if self._finished_out_of_band:
            finished = self._finished_out_of_band + finished
            self._finished_out_of_band = []
        return finished

    def _block_holders(self) -> list[Request]:
        """Requests that may hold blocks a load wrote: running ones and those loading."""
        return list(self.running) + [r for r in self.waiting
                                     if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]

    def _apply_sampled_tokens(self, sampled_token_ids: dict[str, list[int]],
                              num_scheduled: dict[str, int], bad_reqs: set[str]) -> list[Request]:
        """Count the step's tokens, append the sampled ones, finish requests that stop."""
        finished: list[Request] = []
        synced: list[RequestState] = []
        stats = self.stats
        for req in list(self.running):
            rid = req.request_id
            n = num_scheduled.get(rid)
            if n is None:
                continue
            state = self._states[rid]
            sync_load, state.sync_load = state.sync_load, False
            if rid in bad_reqs:
                continue  # this step's sample was computed on bad KV: dropped
            before = req.num_computed_tokens - n
            if sync_load:
                synced.append(state)
                state.count_prompt(stats, "connector", before - req.num_external_computed_tokens,
                                   before)
            state.count_prompt(stats, "computed", before, req.num_computed_tokens)
            sampled = sampled_token_ids.get(rid)
            if sampled:
                req.append_output_token_ids(sampled)
                if self._check_stop(req):
                    self.running.remove(req)
                    self._free_request(state)
                    finished.append(req)
        # Sync-loaded blocks become visible only now that they are known good.
        for state in synced:
            req = state.request
            if not req.is_finished():
                num_cached = min(req.num_computed_tokens, req.num_tokens)
                self.kv_cache_manager.cache_blocks(req, num_cached)
        return finished

    def _apply_transfers(self, kv_out: KVConnectorOutput, finished_recving: set[str],
                         metadata: KVConnectorMetadata | None) -> None:
        """The connector's finished loads and sends, its events, and its report itself."""
        for rid in finished_recving:
            state = self._states.get(rid)
            if state is None:
                continue
            if state.request.is_finished():  # aborted while loading: free now (or after sending)
                self._release_after_load(state)
            else:
                state.load_reported = True
        for rid in kv_out.finished_sending:
            req = self.delayed_free.pop(rid, None)
            if req is not None:
                self.kv_cache_manager.free(req)
                self._states.pop(rid, None)
        self._worker_events.extend(kv_out.kv_cache_events)
        if self.connector is not None:
            self.connector.update_connector_output(kv_out, metadata)

    # -- finishing -------------------------------------------------------------

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish (abort) requests from outside, e.g. a client disconnect."""
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for rid in request_ids:
            state = self._states.get(rid)
            if state is not None and not state.request.is_finished():
                self._abort(state, status)

    def _abort(self, state: RequestState, status: RequestStatus) -> None:
        req = state.request
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        req.status = status
        # A request aborted while its KV is loading keeps its blocks until the
        # connector reports the load finished (the worker may still be writing them).
        keep = loading and not state.load_reported
        # A reported-but-unconsumed load must not leak into a later request reusing the id.
        state.load_reported = state.load_failed = False
        self._free_request(state, keep_blocks=keep)

    def _fail(self, req: Request, reason: str) -> None:
        """Finish ``req`` with FINISHED_ERROR; the next update_from_output reports it."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ERROR
        req.stop_reason = reason
        self.stats.num_requests_failed += 1
        self._finished_out_of_band.append(req)
        self._free_request(self._states[req.request_id])

    def _check_stop(self, req: Request) -> bool:
        if (req.eos_token_id is not None and req.output_token_ids
                and req.output_token_ids[-1] == req.eos_token_id):
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _free_request(self, state: RequestState, keep_blocks: bool = False) -> None:
        """Tell the connector, then free the blocks now or once the connector has sent them.

        With ``keep_blocks`` (aborted during a load) the blocks stay until the
        load is reported finished.
        """
        req = state.request
        rid = req.request_id
        delay = False
        if self.connector is not None:
            block_ids = self.kv_cache_manager.get_block_ids(rid)
            delay, params = self.connector.request_finished(req, block_ids[0] if block_ids else [])
            req.kv_transfer_params = params
        self.finished_req_ids.add(rid)
        state.drop_live_state()
        if keep_blocks:
            if delay:
                state.free_after_load = True
            return  # freed when the connector reports the load finished
        if delay:
            self.delayed_free[rid] = req
        else:
            self.kv_cache_manager.free(req)
            self._states.pop(rid, None)

    def _release_after_load(self, state: RequestState) -> None:
        """Free a request aborted while loading, now that the load reported (or after its send)."""
        req = state.request
        if state.free_after_load:
            state.free_after_load = False
            self.delayed_free[req.request_id] = req
        else:
            self.kv_cache_manager.free(req)
            self._states.pop(req.request_id, None)
