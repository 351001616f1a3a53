"""The adapter's scheduler-role object: vLLM's scheduler hooks, through the guard.

:class:`AdapterScheduler` forwards vLLM's scheduler-side calls (Requests and
KVCacheBlocks as they are, the block pool and the ``SchedulerOutput`` through thin
views, see :mod:`~kvconnector_core.integrations.vllm.views`) to the wrapped connector
through its :class:`~kvconnector_core.connector.guard.GuardedScheduler`, and keeps what
vLLM's records cannot carry: the plans of the steps in flight (a worker's report names
its step), the loads that will not happen (the connector raised while planning them;
:class:`~.records.AdapterMetadata` tells the worker to report them failed) and the
finished requests whose free the connector delayed.

Every load goes to vLLM as an asynchronous receive, the connector's synchronous ones
included: vLLM caches a synchronous load's blocks when it allocates them, so another
request could hit them (and, under async scheduling, compute on them) before a failed
load is reported, and vLLM keeps such a request's tokens
(``Scheduler._update_requests_with_invalid_blocks``). A receive's blocks are cached only
once it is reported, and the worker side reports a synchronous load in the step that ran
it (:attr:`~.records.AdapterMetadata.sync_recving`). The cost is the step the request
waits for its report.

Primitives: :class:`AdapterScheduler`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, cast

from kvconnector_core.connector.guard import GuardedScheduler
from kvconnector_core.integrations.vllm.records import (
    AdapterMetadata,
    AdapterWorkerMetadata,
    output_from_vllm,
    to_vllm_events,
)
from kvconnector_core.integrations.vllm.views import BlockPoolView, SchedulerOutputView

if TYPE_CHECKING:
    from kvconnector_core.connector.base import KVConnectorBase_V1
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["AdapterScheduler"]

_MAX_PLANS_IN_FLIGHT = 64
"""Plans kept for their step's report (vLLM has at most a few steps in flight)."""

_Load = tuple[bool, list[int]]
"""A planned load: (asynchronous for the connector?, the block ids it writes)."""


class AdapterScheduler:
    """The scheduler-role instance's hooks and state (the adapter forwards vLLM's calls here).

    Args:
        connector: the wrapped connector (scheduler-role instance).
        name: the wrapped connector's configured name (for log lines).
        kv_cache_config: kvconnector's view of vLLM's KV cache config (None: unknown).

    Attributes:
        guard: the wrapped connector behind kvconnector's failure contract.
    """

    def __init__(self, connector: KVConnectorBase_V1, name: str,
                 kv_cache_config: KVCacheConfig | None) -> None:
        self.guard = GuardedScheduler(connector)
        self._name = name
        groups = kv_cache_config.kv_cache_groups if kv_cache_config else []
        self._block_size = groups[0].kv_cache_spec.block_size if groups else 1
        # vLLM takes load errors by block id only with one KV cache group.
        self._several_groups = len(groups) > 1
        self._kv_cache_manager: Any = None
        # Plans by step, until their step's report: with async scheduling (vLLM's
        # default) the next plan is built before a step's output is processed.
        self._step = 0
        self._plans: OrderedDict[int, tuple[Any, dict[str, _Load]]] = OrderedDict()
        # rid -> (asynchronous?, the local hit the connector was asked with), until the
        # request's admission (or its end): a deferred asynchronous load is admitted
        # steps after the ask
        self._answers: dict[str, tuple[bool, int]] = {}
        self._step_loads: dict[str, _Load] = {}
        self._step_load_blocks: dict[str, set[int]] = {}  # HMA: rid -> every block its load writes
        # loads that will not happen because planning them raised (the next plan's)
        self._unplanned_recving: set[str] = set()
        # Finished requests whose free the wrapped connector delayed, until reported sent
        # (or their blocks were released for a prefix-cache reset).
        self._delayed_frees: dict[str, Any] = {}
        # Finished requests vLLM keeps until their finished_sending (their free was
        # delayed): the plans list them, and the worker reports a send only for these.
        # Unlike _delayed_frees, a prefix-cache reset keeps them (vLLM still waits).
        self._unreported_sends: set[str] = set()
        self._worker_events: list[Any] = []
        # Requests whose load failed: vLLM asks the connector again when it
        # re-admits them; they recompute instead (as kvconnector's scheduler does),
        # so a persistently failing tier cannot livelock them.
        self._recompute_only: set[str] = set()
        # Loads vLLM waits for, by request: the blocks each writes (first group), until
        # its receive is reported; a load error in them fails the request's load.
        self._receiving: dict[str, set[int]] = {}

    def has_pending_block_frees(self) -> bool:
        """True while a finished request's blocks wait for its stores."""
        return bool(self._delayed_frees)

    # ------------------------------------------------------------ the block pool

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Bind the wrapped connector to vLLM's block pool, and release its pins before
        every prefix-cache reset.

        vLLM resets the block pool first and calls ``reset_cache()`` only after; a
        pool reset fails while any block is pinned (with ``reset_running_requests``
        it raises). So the pool's ``reset_prefix_cache`` is wrapped to call the
        connector's ``reset_cache()`` first.
        """
        self._kv_cache_manager = kv_cache_manager
        pool = kv_cache_manager.block_pool
        self.guard.bind_gpu_block_pool(BlockPoolView(pool))
        pool_reset = pool.reset_prefix_cache

        def reset_prefix_cache() -> bool:
            if not self.guard.reset_cache():
                return False
            self._release_delayed_frees()
            return pool_reset()

        pool.reset_prefix_cache = reset_prefix_cache

    def _release_delayed_frees(self) -> None:
        """Before a prefix-cache reset, free the blocks of finished requests whose stores
        are in flight, when nothing else holds blocks.

        The pool reset fails while any block is in use (vLLM's weight-update path,
        ``reset_running_requests=True``, then raises), and vLLM's own offloading
        connector never holds a finished request's blocks. Their stores are forgotten
        first, so they never become visible (from now on the blocks may be reused);
        vLLM still drops each request when its ``finished_sending`` arrives.
        """
        if not self._delayed_frees:
            return
        managers = self._kv_cache_manager.coordinator.single_type_managers
        holders = {rid for m in managers for rid, blocks in m.req_to_blocks.items() if blocks}
        if not holders <= self._delayed_frees.keys():
            return  # the reset fails anyway (running or loading requests): keep the stores
        self.guard.forget_requests(self._delayed_frees)
        for request in self._delayed_frees.values():
            self._kv_cache_manager.free(request)
        self._delayed_frees = {}

    def reset_cache(self) -> bool | None:
        """Forwarded (idempotent: the wrapped pool reset already called it once)."""
        return self.guard.reset_cache()

    # ------------------------------------------------------------ admission

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Forwarded (vLLM's Request is passed as is); ``(0, False)`` after a failed load.
        A hit is always answered asynchronous (see the module docstring)."""
        if request.request_id in self._recompute_only:
            return 0, False
        num, is_async = self.guard.get_num_new_matched_tokens(request, num_computed_tokens)
        self._answers[request.request_id] = (bool(is_async), num_computed_tokens)
        return num, bool(num)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        """Forwarded (vLLM's KVCacheBlocks is passed as is). If the connector raised while
        planning a load, the load is reported failed by the worker in this step."""
        is_async, local_tokens = self._answers.pop(request.request_id, (True, None))
        ok = self.guard.update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens == 0:
            return
        group = blocks.blocks[0]
        load = (is_async, self._load_block_ids(group, local_tokens, num_external_tokens))
        if not ok:
            self._fail_loads({request.request_id: load})
            return
        self._step_loads[request.request_id] = load
        if self._several_groups:
            # The worker maps load errors to this receive by these blocks (vLLM's
            # null block stands for positions out of a sliding window: never loaded).
            self._step_load_blocks[request.request_id] = {
                b.block_id for g in blocks.blocks for b in g
                if b.block_hash is None and not b.is_null}

    def _load_block_ids(self, group: list[Any], local_tokens: int | None,
                        num_external_tokens: int) -> list[int]:
        """The blocks a load of ``num_external_tokens`` after ``local_tokens`` writes, the
        one it ends in part-way included (a failed load leaves garbage there too).

        The load starts where the local hit the connector was asked with ends: vLLM 0.33
        presents a block-aligned local hit and, when it admits an external hit, keeps
        exactly that local prefix. Without an answer (a deferred load whose ask was
        dropped), the first block without a hash starts it: a receive's blocks are hashed
        only once it arrived.
        """
        bs = self._block_size
        if local_tokens is None:
            start = next((i for i, b in enumerate(group) if b.block_hash is None), len(group))
        else:
            start = local_tokens // bs
        end = start + -(-num_external_tokens // bs)
        return [b.block_id for b in group[start:end] if not b.is_null]

    def _fail_loads(self, loads: dict[str, _Load]) -> None:
        """Have the worker report these loads failed (next plan): vLLM must not wait for them."""
        self._unplanned_recving.update(loads)

    # ------------------------------------------------------------ plans and reports

    def build_connector_meta(self, scheduler_output: Any) -> AdapterMetadata:
        """The wrapped plan (None if building it raised), in a vLLM metadata record."""
        # The view carries every SchedulerOutput field a connector reads (duck-typed).
        view = cast("SchedulerOutput", SchedulerOutputView(scheduler_output))
        plan = self.guard.build_connector_meta(view)
        loads, self._step_loads = self._step_loads, {}
        if plan is None:  # the step's loads are never planned: they fail now
            # vLLM frees (and may reuse) a failed receive's blocks, so the connector must
            # never run the load later: it would still go out with its next plan (the
            # guard forgets only the step's scheduled requests, and a receive is not).
            self.guard.forget_requests(set(loads))
            self._fail_loads(loads)
            loads = {}
        for rid, (_, block_ids) in loads.items():
            self._receiving[rid] = set(block_ids)
        self._step += 1
        self._plans[self._step] = (plan, loads)
        while len(self._plans) > _MAX_PLANS_IN_FLIGHT:  # reports without flags never name a step
            self._plans.popitem(last=False)
        # Failed loads are reported with a plan the connector built: a load it kept pending
        # when planning raised goes out with that plan, and must run while the request
        # still holds its blocks (vLLM frees them once it learns the receive failed). A
        # quarantined connector builds no plan again.
        failed: set[str] = set()
        if plan is not None or self.guard.quarantined:
            failed, self._unplanned_recving = self._unplanned_recving, set()
        meta = AdapterMetadata(plan, failed, step=self._step,
                               load_blocks=self._step_load_blocks,
                               async_loads={rid for rid, (is_async, _) in loads.items()
                                            if is_async},
                               sync_recving={rid for rid, (is_async, _) in loads.items()
                                             if not is_async},
                               delayed_frees=set(self._delayed_frees),
                               unreported_sends=set(self._unreported_sends))
        self._step_load_blocks = {}
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Translate vLLM's output (None sets, wrapped worker metadata) and forward it."""
        out = output_from_vllm(connector_output)
        for rid in out.finished_sending:
            self._delayed_frees.pop(rid, None)
        self._unreported_sends -= out.finished_sending
        self._note_failed_loads(out)
        events = connector_output.kv_cache_events
        if events is not None:
            self._worker_events += events.aggregate().get_all_events()
        plan, loads = self._plan_of(connector_output.kv_connector_worker_meta)
        self.guard.update_connector_output(out, plan)
        if out.loads_failed:
            # The worker could not run the step's loads: the connector may never report
            # the asynchronous ones it has not reported yet (as kvconnector's scheduler
            # does, they fail; reported next step). The synchronous ones the worker
            # reported failed in that step already (AdapterMetadata.sync_recving).
            self._fail_loads({rid: load for rid, load in loads.items()
                              if load[0] and rid not in out.finished_recving})

    def _note_failed_loads(self, out: Any) -> None:
        """Requests whose load failed (a failed receive, or a load error in its blocks)
        recompute when vLLM admits them again, instead of loading again."""
        self._recompute_only |= out.failed_recving
        invalid = out.invalid_block_ids
        if invalid:
            self._recompute_only.update(
                rid for rid, block_ids in self._receiving.items() if block_ids & invalid)
        for rid in out.finished_recving:
            self._receiving.pop(rid, None)

    def _plan_of(self, worker_meta: Any) -> tuple[Any, dict[str, _Load]]:
        """The plan and loads of the step a report names (its worker metadata carries the
        step; a report without it has no failure flags, so needs no plan). Plans of that
        step and older are dropped: reports arrive in step order."""
        step = worker_meta.step if isinstance(worker_meta, AdapterWorkerMetadata) else None
        if step is None:
            return None, {}
        found = self._plans.get(step, (None, {}))
        while self._plans and next(iter(self._plans)) <= step:
            self._plans.popitem(last=False)
        return found

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Forwarded; a delayed free is remembered until it is reported sent."""
        self._recompute_only.discard(request.request_id)
        self._receiving.pop(request.request_id, None)
        self._answers.pop(request.request_id, None)
        delay, params = self.guard.request_finished(request, block_ids)
        if delay:
            self._delayed_frees[request.request_id] = request
            self._unreported_sends.add(request.request_id)
        return bool(delay), params

    def take_events(self) -> list[Any]:
        """The wrapped connector's events, then the workers', as vLLM event objects."""
        events = to_vllm_events(self.guard.take_events())
        events += self._worker_events
        self._worker_events = []
        return events

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The wrapped connector's stats (through the guard)."""
        return self.guard.get_kv_connector_stats()
