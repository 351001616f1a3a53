"""The vLLM ``KVConnectorBase_V1`` subclass that runs any kvconnector connector.

vLLM creates :class:`KVConnectorAdapter` once per role, as it creates any
connector; the adapter creates the kvconnector connector named in
``kv_connector_extra_config["kvconnector"]`` through kvconnector's registry
(built-ins and third-party entry points alike, see
:mod:`~kvconnector_core.integrations.vllm.config`) and the object of its role, which
holds that role's state and to which it forwards every hook:
:class:`~.scheduler.AdapterScheduler` or :class:`~.worker.AdapterWorker`. The
members vLLM reads that kvconnector's base lacks come from vLLM's base class, except
those whose value depends on the wrapped connector, which are overridden here.

Every hook reaches the wrapped connector through kvconnector's guard
(:class:`~kvconnector_core.connector.guard.GuardedScheduler` /
:class:`~kvconnector_core.connector.guard.GuardedWorker`), so a raising hook is
contained inside vLLM exactly as in kvconnector's engine: a miss, a failed load
(reported to vLLM, which recomputes) or a failed store that never becomes
visible. Where the guard needs a report vLLM's records cannot carry, the
adapter carries it itself: the worker's ``loads_failed`` / ``stores_failed``
flags in :class:`~.records.AdapterWorkerMetadata`, and loads the scheduler side
knows will not happen (the connector raised while planning them) in
:class:`~.records.AdapterMetadata`, which the worker reports as failed receives /
load errors so that vLLM never waits for them.

Hook order. vLLM's GPU model runner calls ``handle_preemptions`` *before*
``bind_connector_metadata``; kvconnector's runner calls it after. Both are
allowed by kvconnector's contract (the hook gets the plan as its argument),
and the adapter forwards in vLLM's order; the guard's step starts at whichever
comes first.

Primitives: :class:`KVConnectorAdapter`, :class:`KVConnectorAdapterHMA`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1 as VllmConnectorBase,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole as VllmRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults as VllmTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

from kvconnector_core.connector.base import KVConnectorRole
from kvconnector_core.errors import ConfigError, InvariantError
from kvconnector_core.integrations.vllm.config import (
    connector_config_from_vllm,
    kv_cache_config_from_vllm,
)
from kvconnector_core.integrations.vllm.records import (
    AdapterKVEvents,
    AdapterMetadata,
    AdapterStats,
    AdapterWorkerMetadata,
)
from kvconnector_core.integrations.vllm.scheduler import AdapterScheduler
from kvconnector_core.integrations.vllm.worker import AdapterWorker
from kvconnector_core.plugins.registry import create_connector, get_connector_class

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

    from kvconnector_core.connector.base import KVConnectorBase_V1

__all__ = ["KVConnectorAdapter", "KVConnectorAdapterHMA"]


def _wrapped_class(vllm_config: VllmConfig) -> type[KVConnectorBase_V1]:
    return get_connector_class(connector_config_from_vllm(vllm_config))


class KVConnectorAdapter(VllmConnectorBase):
    """Runs the kvconnector connector named in ``kv_connector_extra_config["kvconnector"]``.

    Select it with ``kv_connector="KVConnectorAdapter"`` and
    ``kv_connector_module_path="kvconnector_core.integrations.vllm"``. It does
    not support vLLM's hybrid KV cache manager (HMA): vLLM turns HMA off for it,
    or refuses an explicit HMA-on; use :class:`KVConnectorAdapterHMA` for a
    connector that handles several KV cache groups.

    Attributes:
        connector: the wrapped kvconnector connector (this role's instance).
        scheduler_side: the scheduler role's object (None on a worker-role instance).
        worker_side: the worker role's object (None on a scheduler-role instance).
    """

    requires_several_groups: ClassVar[bool] = False

    def __init__(self, vllm_config: VllmConfig, role: VllmRole, kv_cache_config: Any) -> None:
        """Create the wrapped connector for ``role``, and the object of that role.

        Raises:
            ConfigError: no or a bad ``kvconnector`` entry in the extra config, an
                unsupported KV cache spec, or the wrapped connector's own config errors.
            RegistryError: the wrapped connector's name is unknown.
        """
        super().__init__(vllm_config, role, kv_cache_config)
        config = connector_config_from_vllm(vllm_config)
        kvc_kv_cache_config = kv_cache_config_from_vllm(kv_cache_config)
        self.connector: KVConnectorBase_V1 = create_connector(
            config, KVConnectorRole(role.value), kvc_kv_cache_config)
        groups = kvc_kv_cache_config.kv_cache_groups if kvc_kv_cache_config else []
        self._check_groups(config.name, len(groups))
        self.scheduler_side: AdapterScheduler | None = None
        self.worker_side: AdapterWorker | None = None
        if role == VllmRole.SCHEDULER:
            self.scheduler_side = AdapterScheduler(self.connector, config.name,
                                                   kvc_kv_cache_config)
        else:
            self.worker_side = AdapterWorker(self.connector, several_groups=len(groups) > 1)

    def _check_groups(self, name: str, num_groups: int) -> None:
        several = bool(getattr(self.connector, "supports_multiple_kv_cache_groups", False))
        if self.requires_several_groups and not several:
            msg = (f"{type(self).__name__} declares HMA support, but the wrapped connector "
                   f"{name!r} handles one KV cache group only; use KVConnectorAdapter (vLLM "
                   "then turns HMA off) or --disable-hybrid-kv-cache-manager")
            raise ConfigError(msg)
        if num_groups > 1 and not several:
            msg = (f"the wrapped connector {name!r} handles one KV cache group, but this "
                   f"model has {num_groups}; run vLLM with --disable-hybrid-kv-cache-manager")
            raise ConfigError(msg)

    def _scheduler(self) -> AdapterScheduler:
        if self.scheduler_side is None:
            msg = "scheduler-side hook called on the adapter's worker-role instance"
            raise InvariantError(msg)
        return self.scheduler_side

    def _worker(self) -> AdapterWorker:
        if self.worker_side is None:
            msg = "worker-side hook called on the adapter's scheduler-role instance"
            raise InvariantError(msg)
        return self.worker_side

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
        side = self.scheduler_side
        return side is not None and side.has_pending_block_frees()

    # ------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Forwarded (see :meth:`AdapterScheduler.bind_kv_cache_manager`)."""
        self._scheduler().bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """Forwarded (see :meth:`AdapterScheduler.get_num_new_matched_tokens`)."""
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int
                                 ) -> None:
        """Forwarded (see :meth:`AdapterScheduler.update_state_after_alloc`)."""
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> AdapterMetadata:
        """The wrapped plan (None if building it raised), in a vLLM metadata record."""
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Translate vLLM's output (None sets, wrapped worker metadata) and forward it."""
        self._scheduler().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Forwarded; a delayed free is remembered until it is reported sent."""
        return self._scheduler().request_finished(request, block_ids)

    def take_events(self) -> list[Any]:
        """The wrapped connector's events, then the workers', as vLLM event objects."""
        return self._scheduler().take_events()

    def reset_cache(self) -> bool | None:
        """Forwarded (idempotent: the wrapped pool reset already called it once)."""
        return self._scheduler().reset_cache()

    # --------------------------------------------------------------- both sides

    def get_kv_connector_stats(self) -> AdapterStats | None:
        """The wrapped stats under vLLM's stats protocol (None when empty)."""
        side: AdapterScheduler | AdapterWorker = self.scheduler_side or self._worker()
        stats = AdapterStats.from_kvconnector(side.get_kv_connector_stats())
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        """Forwarded."""
        self.connector.shutdown()

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Forwarded (see :meth:`AdapterWorker.register_kv_caches`)."""
        self._worker().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Bind the wrapped plan (none when the scheduler side failed to build one)."""
        super().bind_connector_metadata(connector_metadata)
        self._worker().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        """Unbind; the next hook starts the guard's next step."""
        super().clear_connector_metadata()
        self._worker().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Forwarded with the wrapped plan (vLLM calls it before the bind)."""
        self._worker().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Forwarded (model runner V2's extra keyword arguments are dropped)."""
        self._worker().start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Forwarded."""
        self._worker().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Forwarded (extra keyword arguments are dropped)."""
        self._worker().save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        """Forwarded."""
        self._worker().wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> VllmTransferResults:
        """Forwarded (see :meth:`AdapterWorker.get_transfer_results`)."""
        return self._worker().get_transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Legacy form of :meth:`get_transfer_results`."""
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The step's load errors (read in :meth:`get_transfer_results`)."""
        return self._worker().get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> AdapterKVEvents | None:
        """The wrapped worker's events (its optional hook of that name), or None."""
        return self._worker().get_kv_connector_kv_cache_events()

    def build_connector_worker_meta(self) -> AdapterWorkerMetadata | None:
        """The wrapped worker metadata and the guard's step flags, foldable across
        workers (None when there is nothing)."""
        return self._worker().build_connector_worker_meta()


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

    module = "kvconnector_core.integrations.vllm"
    for cls in (KVConnectorAdapter, KVConnectorAdapterHMA):
        try:
            KVConnectorFactory.register_connector(cls.__name__, module, cls.__name__)
        except ValueError:  # already registered (this module imported again)
            continue


_register_with_vllm()
