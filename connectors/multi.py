"""MultiConnector: several connectors behind one, e.g. a TTL pinner + CPU offload.

Config (``extra_config``)::

    {"connectors": [{"name": "TTLPinConnector", "extra_config": {...}},
                    {"name": "cpu_offload", "extra_config": {...}}],
     "loader_policy": "longest"}          # or "first"; default "longest"

Children are listed in priority order; each entry is a
:class:`KVConnectorConfig` dict (``role``, ``engine_id`` and
``load_failure_policy`` default to the parent's) and is created through the
registry, so ``module_path`` works per child.

Semantics:

- **Loads.** Every child is asked ``get_num_new_matched_tokens``; a child
  answering None makes the whole answer ``(None, False)`` (ask again next step;
  this mirrors vLLM, and means one undecided child delays admission). Otherwise
  the :class:`LoaderSelectionPolicy` picks the loader: by default the child with
  the longest hit, ties to the earlier child. Every other child still gets
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
- **Role objects.** The scheduler-role instance is a
  :class:`~connectors.multi_scheduler.MultiSchedulerSide`, the worker-role
  instance a :class:`~connectors.multi_worker.MultiWorkerSide`; policies and
  records live in :mod:`connectors.multi_records`.
- **Stats** are ``{"children": {label: stats}}`` plus the sums of the standard
  byte/second keys, so an engine report works unchanged. **Worker metadata**
  (``build_connector_worker_meta``) is a :class:`MultiKVConnectorWorkerMetadata`
  holding each child's by position. In ``update_connector_output`` child ``i``
  gets a copy of the output carrying its own stats and its own worker
  metadata. **Events** are chained. ``shutdown`` reaches every child and
  raises one :class:`ShutdownError` listing all failures.

Known limitation: the request sets of the :class:`KVConnectorOutput` are the
combined ones, so a child learns that its own delayed free finished only once
every child that delayed the request has finished.

Primitives: :class:`MultiConnector`, :class:`MultiKVConnectorMetadata`,
:class:`MultiLoad`, :class:`LoaderSelectionPolicy`, :class:`LongestHitPolicy`,
:class:`FirstHitPolicy`, :data:`LOADER_POLICIES`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from connectors.multi_records import (
    LOADER_POLICIES,
    FirstHitPolicy,
    LoaderSelectionPolicy,
    LongestHitPolicy,
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
    MultiLoad,
)
from connectors.multi_scheduler import MultiSchedulerSide
from connectors.multi_worker import MultiWorkerSide
from kvconnector_core._suggest import did_you_mean
from kvconnector_core.connector.base import KVConnectorBase_V1, KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.connector.metadata import KVConnectorMetadata
from kvconnector_core.connector.registry import ConnectorRegistry, create_connector
from kvconnector_core.connector.roles import RoleSplitConnector
from kvconnector_core.connector.settings import ConnectorSettings
from kvconnector_core.errors import (
    ConfigError,
    DuplicateConnectorError,
    InvalidConnectorError,
    PluginLoadError,
    ShutdownError,
    UnknownConnectorError,
)

# Errors whose constructor takes one message: a child's is re-raised prefixed with its index.
_RELABELLED_ERRORS = (ConfigError, UnknownConnectorError, DuplicateConnectorError,
                      InvalidConnectorError, PluginLoadError)
# The keys MultiConnector reads from its extra_config (the children read their own).
_EXTRA_KEYS = frozenset({"connectors", "loader_policy"})

if TYPE_CHECKING:
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig

__all__ = [
    "LOADER_POLICIES",
    "FirstHitPolicy",
    "LoaderSelectionPolicy",
    "LongestHitPolicy",
    "MultiConnector",
    "MultiKVConnectorMetadata",
    "MultiKVConnectorWorkerMetadata",
    "MultiLoad",
    "MultiSettings",
]


class MultiSettings(ConnectorSettings):
    """MultiConnector's ``extra_config``.

    Attributes:
        connectors: the children's configs, in priority order (checked when they are created).
        loader_policy: a key of :data:`LOADER_POLICIES`.
    """

    connectors: list[Any] | None = None
    loader_policy: str = "longest"


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
        # The children exist before the facade creates the role object that holds them.
        self._children = [
            self._create_child(i, cfg, role, kv_cache_config, registry)
            for i, cfg in enumerate(self._child_configs(config))
        ]
        self.labels = self._make_labels(self._children)
        """Per child: its name, or ``name#index`` when several children share it."""
        self._policy = loader_policy or self._policy_from_config(config)
        self.supports_async_load = any(c.supports_async_load for c in self._children)  # type: ignore[misc]
        self.has_sync_kv_loads = any(c.has_sync_kv_loads for c in self._children)  # type: ignore[misc]
        self.requires_block_pool = any(c.requires_block_pool for c in self._children)  # type: ignore[misc]
        # Hybrid models only when every child handles them (a child that does not was
        # already refused when it was created with this kv_cache_config).
        self.supports_multiple_kv_cache_groups = all(  # type: ignore[misc]
            c.supports_multiple_kv_cache_groups for c in self._children)
        self._is_shut_down = False
        super().__init__(config, role, kv_cache_config)

    def make_scheduler_side(self) -> MultiSchedulerSide:
        """The scheduler-side object (children behind their guards)."""
        return MultiSchedulerSide(self._children, self.labels, self._policy,
                                  self._first_group_block_size(self._kv_cache_config))

    def make_worker_side(self) -> MultiWorkerSide:
        """The worker-side object (children behind their guards)."""
        return MultiWorkerSide(self._children, self.labels)

    def get_kv_connector_kv_cache_events(self) -> list[Any]:
        """Worker role: the children's worker-side events, in child order (vLLM's optional hook)."""
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
    def _child_configs(config: KVConnectorConfig) -> list[KVConnectorConfig]:
        if not isinstance(config, KVConnectorConfig):
            msg = f"MultiConnector needs a KVConnectorConfig, got {type(config).__qualname__}: {config!r}"
            raise ConfigError(msg)
        unknown = sorted(set(config.extra_config) - _EXTRA_KEYS)
        if unknown:
            # A misspelt 'connectors' would otherwise read as "got None" below.
            msg = (f"MultiConnector: unknown extra_config key {unknown[0]!r}"
                   f"{did_you_mean(unknown[0], _EXTRA_KEYS)}; valid keys: "
                   f"{', '.join(sorted(_EXTRA_KEYS))}")
            raise ConfigError(msg)
        raw = config.extra_config.get("connectors")
        if not isinstance(raw, list) or not raw:
            msg = (
                f"MultiConnector needs extra_config['connectors'], a non-empty list of connector "
                f"configs (dicts with at least 'name'), got {raw!r}"
            )
            raise ConfigError(msg)
        inherited = {
            "role": config.role,
            "engine_id": config.engine_id,
            "load_failure_policy": config.load_failure_policy,
            "enable_kv_cache_events": config.enable_kv_cache_events,
            # Every child runs on every worker: a store is complete only once all report it.
            "world_size": config.world_size,
            # ... and on each worker holds that worker's shard of every block.
            "rank": config.rank,
            "pipeline_parallel_size": config.pipeline_parallel_size,
        }
        configs = []
        for i, child in enumerate(raw):
            if isinstance(child, KVConnectorConfig):
                configs.append(child)
                continue
            if not isinstance(child, dict):
                msg = f"MultiConnector extra_config['connectors'][{i}] must be a dict, got {child!r}"
                raise ConfigError(msg)
            try:
                configs.append(KVConnectorConfig.from_dict({**inherited, **child}))
            except ConfigError as exc:
                msg = f"MultiConnector extra_config['connectors'][{i}]: {exc}"
                raise ConfigError(msg) from exc
        for i, cfg in enumerate(configs):
            first = configs.index(cfg)
            if first < i:  # every child stores every block: a repeated child stores it twice
                msg = (f"MultiConnector extra_config['connectors'][{i}] repeats child {first} "
                       f"({cfg.name!r} with the same settings); remove one of them")
                raise ConfigError(msg)
        return configs

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
    def _policy_from_config(config: KVConnectorConfig) -> LoaderSelectionPolicy:
        key = config.extra_config.get("loader_policy", "longest")
        if key not in LOADER_POLICIES:
            msg = f"MultiConnector loader_policy {key!r} is unknown; known policies: {sorted(LOADER_POLICIES)}"
            raise ConfigError(msg)
        return LOADER_POLICIES[key]()

    @staticmethod
    def _first_group_block_size(kv_cache_config: KVCacheConfig | None) -> int | None:
        try:
            # A missing config (None) is one of the cases the except below handles.
            return int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)  # type: ignore[union-attr]
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
            except Exception as exc:  # noqa: BLE001 - every child is shut down; all failures are raised below
                failures.append((self.labels[i], exc))
        if failures:
            raise ShutdownError(failures)
