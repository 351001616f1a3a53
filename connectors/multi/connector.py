"""MultiConnector: several connectors behind one, e.g. a TTL pinner + CPU offload.

Config: ``extra_config`` lists the children in priority order
(:class:`~connectors.multi.config.MultiSettings`); each is created through the registry,
so ``module_path`` works per child.

Semantics:

- **Loads.** Every child is asked ``get_num_new_matched_tokens``; a child
  answering None makes the whole answer ``(None, False)`` (ask again next step;
  this mirrors vLLM, and means one undecided child delays admission). Otherwise
  the :class:`~connectors.multi.policy.LoaderSelectionPolicy` picks the loader: by
  default the child with the longest hit, ties to the earlier child. Every other child still gets
  ``update_state_after_alloc`` with the same blocks and 0 external tokens, so it
  can plan saves.
- **Completions.** A request delays its block free if any child asks to, and is
  reported in ``finished_sending`` exactly once, after every child that delayed
  it has reported it. Receives and load errors are unions.
- **Failure contract.** Every child is called through its own guard
  (:mod:`kvconnector_core.connector.guard`), so a child that raises is contained
  exactly as a top-level connector is (``docs/failure-contract.md``), and
  counted per child in the stats' ``hook_errors``. If the child was the loader
  of a request and its admission or plan failed, that load is reported as
  failed by the worker side (blocks in ``get_block_ids_with_load_errors``; an
  asynchronous load also as a failed receive), so the scheduler recomputes
  instead of reading KV that never arrived. A child whose bind or load hook
  raises has its loads of that step reported the same way; a child whose save
  hooks raise has its stores failed (``plan_failed`` on its scheduler side).
  ``register_kv_caches`` and ``bind_gpu_block_pool`` are not contained: the
  first error propagates as :class:`ConnectorHookError` after the other
  children ran. ``handle_preemptions`` reaches every child with a plan this
  step, with that child's own plan.
- **Role objects.** The scheduler-role instance holds a
  :class:`~connectors.multi.scheduler.MultiSchedulerSide`, the worker-role
  instance a :class:`~connectors.multi.worker.MultiWorkerSide`; what they send each
  other is in :mod:`connectors.multi.records`, the loader policies in
  :mod:`connectors.multi.policy`.
- **Stats** are ``{"children": {label: stats}}`` plus the sums of the standard
  byte/second keys, so an engine report works unchanged. **Worker metadata**
  (``build_connector_worker_meta``) is a
  :class:`~connectors.multi.records.MultiKVConnectorWorkerMetadata` holding each
  child's by position. In ``update_connector_output`` child ``i``
  gets a copy of the output carrying its own stats and its own worker
  metadata. **Events** are chained. ``shutdown`` reaches every child and
  raises one :class:`ShutdownError` listing all failures.

Known limitation: the request sets of the :class:`KVConnectorOutput` are the
combined ones, so a child learns that its own delayed free finished only once
every child that delayed the request has finished.

Primitives: :class:`MultiConnector`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from connectors.multi.config import MultiSettings
from connectors.multi.records import MultiKVConnectorMetadata
from connectors.multi.scheduler import MultiSchedulerSide
from connectors.multi.worker import MultiWorkerSide
from kvconnector_core.connector.base import KVConnectorBase_V1, KVConnectorRole, RoleSplitConnector
from kvconnector_core.connector.metadata import KVConnectorMetadata
from kvconnector_core.errors import (
    ConfigError,
    DuplicateConnectorError,
    InvalidConnectorError,
    PluginLoadError,
    ShutdownError,
    UnknownConnectorError,
)
from kvconnector_core.plugins.registry import ConnectorRegistry, create_connector

if TYPE_CHECKING:
    from connectors.multi.policy import LoaderSelectionPolicy
    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig

__all__ = ["MultiConnector"]

# Errors whose constructor takes one message: a child's is re-raised prefixed with its index.
_RELABELLED_ERRORS = (ConfigError, UnknownConnectorError, DuplicateConnectorError,
                      InvalidConnectorError, PluginLoadError)


class MultiConnector(RoleSplitConnector):
    """Composes child connectors; see the module docstring for the semantics.

    On an instance, the capability attributes reflect the children (any child
    able to load asynchronously makes the multi able to, and so on).
    """

    name: ClassVar[str] = "MultiConnector"
    metadata_type: ClassVar[type[KVConnectorMetadata]] = MultiKVConnectorMetadata
    supports_async_load: ClassVar[bool] = True
    has_sync_kv_loads: ClassVar[bool] = True
    settings_type: ClassVar[type[Any] | None] = MultiSettings

    def __init__(
        self,
        config: KVConnectorConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
        *,
        registry: ConnectorRegistry | None = None,
        loader_policy: LoaderSelectionPolicy | None = None,
    ) -> None:
        """Create the children for ``role``.

        Args:
            config: the multi's config; ``extra_config["connectors"]`` lists the children.
            role: the role (every child gets the same).
            kv_cache_config: the engine's KV cache layout (passed to the children).
            registry: where child names are looked up; default: the default registry.
            loader_policy: overrides ``extra_config["loader_policy"]``.

        Raises:
            ConfigError: ``connectors`` is missing, empty or malformed, or the
                loader policy is unknown.
            RegistryError: a child's name cannot be resolved (the error notes the child).
        """
        settings = MultiSettings.from_config(config)
        # The children exist before the facade creates the role object that holds them.
        self._children = [
            self._create_child(i, cfg, role, kv_cache_config, registry)
            for i, cfg in enumerate(settings.child_configs(config))
        ]
        self.labels = self._make_labels(self._children)
        """Per child: its name, or ``name#index`` when several children share it."""
        self._policy = loader_policy or settings.make_policy()
        self._mirror_children()
        self._is_shut_down = False
        # Converted above, before the children exist; children given as ready
        # KVConnectorConfig objects are not the plain data the base class converts.
        self.settings_type = None  # type: ignore[misc]  # ClassVar hidden while the base runs
        super().__init__(config, role, kv_cache_config)
        del self.settings_type
        self._settings = settings

    def _mirror_children(self) -> None:
        """Set the capability attributes from the children (per instance)."""
        children = self._children
        self.supports_async_load = any(  # type: ignore[misc]  # ClassVar set per instance
            c.supports_async_load for c in children)
        self.has_sync_kv_loads = any(  # type: ignore[misc]  # ClassVar set per instance
            c.has_sync_kv_loads for c in children)
        self.requires_block_pool = any(  # type: ignore[misc]  # ClassVar set per instance
            c.requires_block_pool for c in children)
        # Hybrid models only when every child handles them (a child that does not was
        # already refused when it was created with this kv_cache_config).
        self.supports_multiple_kv_cache_groups = all(  # type: ignore[misc]
            c.supports_multiple_kv_cache_groups for c in children)

    def make_scheduler_side(self) -> MultiSchedulerSide:
        """The scheduler-side object (children behind their guards)."""
        return MultiSchedulerSide(self._children, self.labels, self._policy,
                                  self._first_group_block_size(self._kv_cache_config))

    def make_worker_side(self) -> MultiWorkerSide:
        """The worker-side object (children behind their guards)."""
        return MultiWorkerSide(self._children, self.labels)

    def get_kv_connector_kv_cache_events(self) -> list[Any]:
        """Worker role: the children's worker-side events, in child order (vLLM's optional
        hook)."""
        side = self.worker_side
        assert isinstance(side, MultiWorkerSide)  # noqa: S101 - built by make_worker_side
        return side.get_kv_connector_kv_cache_events()

    def num_request_states(self) -> int:
        """Requests this connector still keeps state for (0 once every request is done)."""
        side = self._scheduler_side or self._worker_side
        assert isinstance(side, MultiSchedulerSide | MultiWorkerSide)  # noqa: S101 - built above
        return side.num_request_states()

    # ----------------------------------------------------------- construction

    @staticmethod
    def _create_child(index: int, cfg: KVConnectorConfig, role: KVConnectorRole,
                      kv_cache_config: KVCacheConfig | None,
                      registry: ConnectorRegistry | None) -> KVConnectorBase_V1:
        try:
            return create_connector(cfg, role, kv_cache_config, registry=registry)
        except _RELABELLED_ERRORS as exc:
            if type(exc) not in _RELABELLED_ERRORS:
                raise
            # The same message as for a top-level connector, prefixed with where it is.
            msg = f"MultiConnector extra_config['connectors'][{index}]: {exc}"
            raise type(exc)(msg) from exc
        except Exception as exc:
            exc.add_note(f"while creating MultiConnector child {index} ({cfg.name!r})")
            raise

    @staticmethod
    def _make_labels(children: Sequence[KVConnectorBase_V1]) -> list[str]:
        counts = Counter(c.name for c in children)
        return [c.name if counts[c.name] == 1 else f"{c.name}#{i}" for i, c in enumerate(children)]

    @staticmethod
    def _first_group_block_size(kv_cache_config: KVCacheConfig | None) -> int | None:
        try:
            # A missing config (None) is one of the cases the except below handles.
            spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec  # type: ignore[union-attr]
            return int(spec.block_size)
        except (AttributeError, IndexError, TypeError):
            return None

    @property
    def children(self) -> tuple[KVConnectorBase_V1, ...]:
        """The child connectors, in priority order."""
        return tuple(self._children)

    def shutdown(self) -> None:
        """Shut every child down (once); raise one ShutdownError listing every failure."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        failures: list[tuple[str, BaseException]] = []
        for i, child in enumerate(self._children):
            try:
                child.shutdown()
            # Every child is shut down; all failures are raised below.
            except Exception as exc:  # noqa: BLE001
                failures.append((self.labels[i], exc))
        if failures:
            raise ShutdownError(failures)
