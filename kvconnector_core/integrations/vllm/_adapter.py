"""The vLLM ``KVConnectorBase_V1`` subclass that runs any kvconnector connector.

vLLM creates :class:`KVConnectorAdapter` once per role, as it creates any
connector; the adapter creates the kvconnector connector named in
``kv_connector_extra_config["kvconnector"]`` through kvconnector's registry
(built-ins and third-party entry points alike) and forwards every hook,
translating the records at the boundary (see ``_records``) and passing thin
views of vLLM's live objects (see ``_views``). The worker role's per-step hooks
come from the base class :class:`~._worker_side.AdapterWorkerHooks`. The members
vLLM reads that kvconnector's base lacks come from vLLM's base class, except those
whose value depends on the wrapped connector, which are overridden here.

Every hook reaches the wrapped connector through kvconnector's guard
(:class:`~kvconnector_core.connector.guard.GuardedScheduler` /
:class:`~kvconnector_core.connector.guard.GuardedWorker`), so a raising hook is
contained inside vLLM exactly as in kvconnector's engine: a miss, a failed load
(reported to vLLM, which recomputes) or a failed store that never becomes
visible. Where the guard needs a report vLLM's records cannot carry, the
adapter carries it itself: the worker's ``loads_failed`` / ``stores_failed``
flags in :class:`AdapterWorkerMetadata`, and loads the scheduler side knows
will not happen (the connector raised while planning them) in
:class:`AdapterMetadata`, which the worker reports as failed receives / load
errors so that vLLM never waits for them.

Hook order. vLLM's GPU model runner calls ``handle_preemptions`` *before*
``bind_connector_metadata``; kvconnector's runner calls it after. Both are
allowed by kvconnector's contract (the hook gets the plan as its argument),
and the adapter forwards in vLLM's order; the guard's step starts at whichever
comes first.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, ClassVar, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole as VllmRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

from kvconnector_core.connector.base import KVConnectorRole
from kvconnector_core.connector.guard import GuardedScheduler, GuardedWorker
from kvconnector_core.connector.registry import create_connector, get_connector_class
from kvconnector_core.errors import ConfigError, InvariantError
from kvconnector_core.integrations.vllm._layouts import block_dense_views
from kvconnector_core.integrations.vllm._records import (
    AdapterMetadata,
    AdapterStats,
    AdapterWorkerMetadata,
    connector_config_from_vllm,
    kv_cache_config_from_vllm,
    output_from_vllm,
    to_vllm_events,
)
from kvconnector_core.integrations.vllm._views import BlockPoolView, SchedulerOutputView
from kvconnector_core.integrations.vllm._worker_side import AdapterWorkerHooks

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

    from kvconnector_core.connector.base import KVConnectorBase_V1
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["KVConnectorAdapter", "KVConnectorAdapterHMA"]

logger = logging.getLogger(__name__)

_MAX_PLANS_IN_FLIGHT = 64
"""Plans kept for their step's report (vLLM has at most a few steps in flight)."""


def _wrapped_class(vllm_config: VllmConfig) -> type[KVConnectorBase_V1]:
    return get_connector_class(connector_config_from_vllm(vllm_config))


class KVConnectorAdapter(AdapterWorkerHooks):
    """Runs the kvconnector connector named in ``kv_connector_extra_config["kvconnector"]``.

    Select it with ``kv_connector="KVConnectorAdapter"`` and
    ``kv_connector_module_path="kvconnector_core.integrations.vllm"``. It does
    not support vLLM's hybrid KV cache manager (HMA): vLLM turns HMA off for it,
    or refuses an explicit HMA-on; use :class:`KVConnectorAdapterHMA` for a
    connector that handles several KV cache groups.

    Attributes:
        connector: the wrapped kvconnector connector (this role's instance).
    """

    requires_several_groups: ClassVar[bool] = False

    def __init__(self, vllm_config: VllmConfig, role: VllmRole, kv_cache_config: Any) -> None:
        """Create the wrapped connector for ``role``.

        Raises:
            ConfigError: no or a bad ``kvconnector`` entry in the extra config, an
                unsupported KV cache spec, or the wrapped connector's own config errors.
            RegistryError: the wrapped connector's name is unknown.
        """
        super().__init__(vllm_config, role, kv_cache_config)
        self._kvc_config = connector_config_from_vllm(vllm_config)
        self._kvc_kv_cache_config = kv_cache_config_from_vllm(kv_cache_config)
        self.connector: KVConnectorBase_V1 = create_connector(
            self._kvc_config, KVConnectorRole(role.value), self._kvc_kv_cache_config)
        self._check_groups()
        is_scheduler = role == VllmRole.SCHEDULER
        self._sched = GuardedScheduler(self.connector) if is_scheduler else None
        self._worker = None if is_scheduler else GuardedWorker(self.connector)
        groups = self._kvc_kv_cache_config.kv_cache_groups if self._kvc_kv_cache_config else []
        self._block_size = groups[0].kv_cache_spec.block_size if groups else 1
        # vLLM takes load errors by block id only with one KV cache group.
        self._several_groups = len(groups) > 1
        # scheduler side: the last plan (update_connector_output's step), this step's
        # answers, and loads that will not happen because planning them raised
        # Plans by step, until their step's report: with async scheduling (vLLM's
        # default) the next plan is built before a step's output is processed.
        self._step = 0
        self._reported_step = 0  # the newest step a report named (see AdapterMetadata)
        self._plans: OrderedDict[int, tuple[Any, dict[str, tuple[bool, list[int]]]]] = OrderedDict()
        # rid -> (asynchronous?, the local hit the connector was asked with), until the
        # request's admission (or its end): a deferred asynchronous load is admitted
        # steps after the ask
        self._answers: dict[str, tuple[bool, int]] = {}
        self._step_loads: dict[str, tuple[bool, list[int]]] = {}  # rid -> (async, block ids)
        self._step_load_blocks: dict[str, set[int]] = {}  # HMA: rid -> every block its load writes
        self._unplanned_recving: set[str] = set()
        self._unplanned_blocks: set[int] = set()
        self._warned_sync_hma = False
        self._init_worker_state()
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

    def _check_groups(self) -> None:
        groups = self._kvc_kv_cache_config.kv_cache_groups if self._kvc_kv_cache_config else []
        several = bool(getattr(self.connector, "supports_multiple_kv_cache_groups", False))
        if self.requires_several_groups and not several:
            msg = (f"{type(self).__name__} declares HMA support, but the wrapped connector "
                   f"{self._kvc_config.name!r} handles one KV cache group only; use "
                   "KVConnectorAdapter (vLLM then turns HMA off) or --disable-hybrid-kv-cache-manager")
            raise ConfigError(msg)
        if len(groups) > 1 and not several:
            msg = (f"the wrapped connector {self._kvc_config.name!r} handles one KV cache group, "
                   f"but this model has {len(groups)}; run vLLM with --disable-hybrid-kv-cache-manager")
            raise ConfigError(msg)

    # ------------------------------------------------------------ capabilities

    @property
    def requires_kv_delivery(self) -> bool:
        """False unless the wrapped connector says so: kvconnector's connectors are caches,
        where a save dropped by a preemption is only a future miss."""
        return bool(getattr(self.connector, "requires_kv_delivery", False))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The wrapped connector class's ``required_kv_cache_layout`` (None: any of the six)."""
        return getattr(_wrapped_class(vllm_config), "required_kv_cache_layout", None)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> AdapterStats:
        """Rebuild stats shipped as ``to_dict()`` (vLLM's logger does this per interval)."""
        return AdapterStats() if data is None else AdapterStats(data=data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        """The wrapped connector's Prometheus series on vLLM's registry (see
        :mod:`kvconnector_core.integrations.vllm.prom_metrics` and docs/metrics.md)."""
        from kvconnector_core.integrations.vllm import prom_metrics

        return prom_metrics.build_prom_metrics(vllm_config, metric_types, labelnames,
                                               per_engine_labelvalues)

    def has_pending_block_frees(self) -> bool:
        """True while a finished request's blocks wait for its stores: vLLM then waits
        for them instead of preempting when an allocation fails."""
        return bool(self._delayed_frees)

    # ------------------------------------------------------------ scheduler side

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
        self._scheduler().bind_gpu_block_pool(BlockPoolView(pool))
        pool_reset = pool.reset_prefix_cache

        def reset_prefix_cache() -> bool:
            if not self._scheduler().reset_cache():
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
        self._scheduler().forget_requests(self._delayed_frees)
        for request in self._delayed_frees.values():
            self._kv_cache_manager.free(request)
        self._delayed_frees = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Forwarded (vLLM's Request is passed as is); ``(0, False)`` after a failed load,
        and for a synchronous hit when the model has several KV cache groups (vLLM could
        not be told which of its blocks failed to load)."""
        if request.request_id in self._recompute_only:
            return 0, False
        num, is_async = self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)
        if num and not is_async and self._several_groups:
            if not self._warned_sync_hma:
                self._warned_sync_hma = True
                logger.error("connector %r answered a synchronous load under vLLM's hybrid KV cache "
                             "manager, where a failed one cannot be reported; its synchronous hits "
                             "are recomputed instead (load asynchronously to serve them)",
                             self._kvc_config.name)
            return 0, False
        self._answers[request.request_id] = (bool(is_async), num_computed_tokens)
        return num, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Forwarded (vLLM's KVCacheBlocks is passed as is). If the connector raised while
        planning a load, the load is reported failed by the worker in this step."""
        is_async, local_tokens = self._answers.pop(request.request_id, (True, None))
        ok = self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens == 0:
            return
        load = (is_async, self._load_block_ids(blocks.blocks[0], local_tokens, num_external_tokens))
        if ok:
            self._step_loads[request.request_id] = load
            if is_async and self._several_groups:
                # The worker maps load errors to this receive by these blocks (vLLM's
                # null block stands for positions out of a sliding window: never loaded).
                self._step_load_blocks[request.request_id] = {
                    b.block_id for g in blocks.blocks for b in g if b.block_hash is None and not b.is_null}
        else:
            self._fail_loads({request.request_id: load})

    def _load_block_ids(self, group: list[Any], local_tokens: int | None, num_external_tokens: int
                        ) -> list[int]:
        """The blocks a load of ``num_external_tokens`` after ``local_tokens`` writes, the
        one it ends in part-way included (a failed load leaves garbage there too).

        The load starts where the local hit the connector was asked with ends: vLLM 0.33
        presents a block-aligned local hit and, when it admits an external hit, keeps
        exactly that local prefix. The blocks' hashes cannot tell it: vLLM hashes a
        synchronous load's blocks (and those the step computes) when it allocates them.
        Without an answer (a deferred asynchronous load whose ask was dropped), the first
        block without a hash starts it: asynchronous loads' blocks are hashed only once
        they arrived.
        """
        bs = self._block_size
        if local_tokens is None:
            start = next((i for i, b in enumerate(group) if b.block_hash is None), len(group))
        else:
            start = local_tokens // bs
        end = start + -(-num_external_tokens // bs)
        return [b.block_id for b in group[start:end] if not b.is_null]

    def _fail_loads(self, loads: dict[str, tuple[bool, list[int]]]) -> None:
        """Have the worker report these loads failed (next plan): vLLM must not wait for them."""
        for rid, (is_async, block_ids) in loads.items():
            if is_async:
                self._unplanned_recving.add(rid)
            else:
                self._unplanned_blocks.update(block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> AdapterMetadata:
        """The wrapped plan (None if building it raised), in a vLLM metadata record."""
        # The view carries every SchedulerOutput field a connector reads (duck-typed).
        view = cast("SchedulerOutput", SchedulerOutputView(scheduler_output))
        plan = self._scheduler().build_connector_meta(view)
        loads, self._step_loads = self._step_loads, {}
        if plan is None:  # the step's loads are never planned: they fail now
            # vLLM frees (and may reuse) a failed receive's blocks, so the connector must
            # never run the load later: an asynchronous one would still go out with its
            # next plan (the guard forgets only the step's scheduled requests).
            self._scheduler().forget_requests({rid for rid, (is_async, _) in loads.items()
                                               if is_async})
            self._fail_loads(loads)
            loads = {}
        self._step += 1
        self._plans[self._step] = (plan, loads)
        while len(self._plans) > _MAX_PLANS_IN_FLIGHT:  # reports without flags never name a step
            self._plans.popitem(last=False)
        sync_blocks = {b for is_async, ids in loads.values() if not is_async for b in ids}
        meta = AdapterMetadata(plan, self._unplanned_recving, self._unplanned_blocks, step=self._step,
                               load_blocks=self._step_load_blocks, sync_load_blocks=sync_blocks,
                               reported_step=self._reported_step,
                               async_loads={rid for rid, (is_async, _) in loads.items() if is_async},
                               delayed_frees=set(self._delayed_frees),
                               unreported_sends=set(self._unreported_sends))
        self._unplanned_recving, self._unplanned_blocks = set(), set()
        self._step_load_blocks = {}
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Translate vLLM's output (None sets, wrapped worker metadata) and forward it."""
        out = output_from_vllm(connector_output)
        for rid in out.finished_sending:
            self._delayed_frees.pop(rid, None)
        self._unreported_sends -= out.finished_sending
        self._recompute_only |= out.failed_recving
        events = connector_output.kv_cache_events
        if events is not None:
            self._worker_events += events.aggregate().get_all_events()
        plan, loads = self._plan_of(connector_output.kv_connector_worker_meta)
        self._scheduler().update_connector_output(out, plan)
        if out.loads_failed:
            # The worker could not run the step's loads: the connector may never report
            # the asynchronous ones it has not reported yet (as kvconnector's scheduler
            # does, they fail; reported next step). The synchronous ones the worker
            # reported invalid in that step already (AdapterMetadata.sync_load_blocks).
            self._fail_loads({rid: load for rid, load in loads.items()
                              if load[0] and rid not in out.finished_recving})

    def _plan_of(self, worker_meta: Any) -> tuple[Any, dict[str, tuple[bool, list[int]]]]:
        """The plan and loads of the step a report names (its worker metadata carries the
        step; a report without it has no failure flags, so needs no plan). Plans of that
        step and older are dropped: reports arrive in step order."""
        step = worker_meta.step if isinstance(worker_meta, AdapterWorkerMetadata) else None
        if step is None:
            return None, {}
        self._reported_step = max(self._reported_step, step)
        found = self._plans.get(step, (None, {}))
        while self._plans and next(iter(self._plans)) <= step:
            self._plans.popitem(last=False)
        return found

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forwarded; a delayed free is remembered until it is reported sent."""
        self._recompute_only.discard(request.request_id)
        self._answers.pop(request.request_id, None)
        delay, params = self._scheduler().request_finished(request, block_ids)
        if delay:
            self._delayed_frees[request.request_id] = request
            self._unreported_sends.add(request.request_id)
        return bool(delay), params

    def take_events(self) -> list[Any]:
        """The wrapped connector's events, then the workers', as vLLM event objects."""
        events = to_vllm_events(self._scheduler().take_events())
        events += self._worker_events
        self._worker_events = []
        return events

    def reset_cache(self) -> bool | None:
        """Forwarded (idempotent: the wrapped pool reset already called it once)."""
        return self._scheduler().reset_cache()

    # --------------------------------------------------------------- both sides

    def get_kv_connector_stats(self) -> AdapterStats | None:
        """The wrapped stats under vLLM's stats protocol (None when empty)."""
        side = self._sched if self._sched is not None else self._worker
        # mypy: exactly one of the two sides is set (hence the ignore)
        stats = AdapterStats.from_kvconnector(side.get_kv_connector_stats())  # type: ignore[union-attr]
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        """Forwarded."""
        self.connector.shutdown()

    def _scheduler(self) -> GuardedScheduler:
        if self._sched is None:
            msg = "scheduler-side hook called on the adapter's worker-role instance"
            raise InvariantError(msg)
        return self._sched

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Hand vLLM's per-layer tensors over as block-dense views (no copies; see ``_layouts``)."""
        views: dict[str, torch.Tensor] = {}
        for name, tensor in kv_caches.items():
            views.update(block_dense_views(name, tensor))
        self._guard().register_kv_caches(views)


class KVConnectorAdapterHMA(KVConnectorAdapter, SupportsHMA):
    """:class:`KVConnectorAdapter` with vLLM's HMA enabled, for connectors that handle
    several KV cache groups (``supports_multiple_kv_cache_groups``)."""

    requires_several_groups: ClassVar[bool] = True

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with the first group's block ids (kvconnector's contract)."""
        return self.request_finished(request, block_ids[0])


def _register_with_vllm() -> None:
    """Register both adapters by name in vLLM's connector factory.

    vLLM's own MultiConnector rebuilds its children's shipped stats by class name
    (``KVConnectorFactory.get_connector_class_by_name``, in the stats logger); an
    adapter only loaded through ``kv_connector_module_path`` would not be found
    there, and the logger would raise. Registering also lets a config name the
    adapter without the module path once this module is imported.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for cls in (KVConnectorAdapter, KVConnectorAdapterHMA):
        try:
            KVConnectorFactory.register_connector(cls.__name__, "kvconnector_core.integrations.vllm", cls.__name__)
        except ValueError:  # already registered (this module imported again)
            continue


_register_with_vllm()
