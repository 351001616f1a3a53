"""The connector base class: :class:`KVConnectorBase_V1` (alias :data:`KVConnectorBase`).

A connector moves KV cache between the engine's GPU block pool and somewhere
else (CPU memory, disk, another engine). One connector class is instantiated
twice, once per role, as ``cls(config, role, kv_cache_config)``:

- the **scheduler** side (:attr:`KVConnectorRole.SCHEDULER`) decides what to
  load and save: ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
  ``build_connector_meta``, ``update_connector_output``, ``request_finished``,
  ``take_events``, ``get_event_snapshot``, ``bind_gpu_block_pool``;
- the **worker** side (:attr:`KVConnectorRole.WORKER`) moves the bytes:
  ``register_kv_caches``, ``start_load_kv``, ``wait_for_layer_load``,
  ``save_kv_layer``, ``wait_for_save``, ``get_finished``,
  ``get_block_ids_with_load_errors``.

The two sides share nothing but a :class:`KVConnectorMetadata` plan (scheduler
-> worker, bound each step) and a :class:`KVConnectorOutput` (worker ->
scheduler). Method names and meanings follow vLLM's V1 connector API so a
connector ports between the two with little change.

Seven hooks are abstract (a connector must decide what they do); every other
hook has a documented no-op default. Capabilities are class attributes, so the
registry, the engine and ``kvconnector list`` can read them without creating an
instance.

Primitives: :class:`KVConnectorRole`, :class:`KVConnectorBase_V1`,
:data:`KVConnectorBase`, :data:`ABSTRACT_HOOKS`, :data:`OPTIONAL_HOOKS`.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, ClassVar

from kvconnector_core.connector._scheduler_hooks import _SchedulerHooks
from kvconnector_core.connector._worker_hooks import _WorkerHooks
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.connector.metadata import KVConnectorMetadata
from kvconnector_core.errors import ConfigError

if TYPE_CHECKING:  # the base must not import torch or the KV cache core at import time
    from kvconnector_core.connector.demo import DemoOptions
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheManager
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig

__all__ = [
    "ABSTRACT_HOOKS",
    "OPTIONAL_HOOKS",
    "KVConnectorBase",
    "KVConnectorBase_V1",
    "KVConnectorRole",
]

ABSTRACT_HOOKS: tuple[str, ...] = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
)
"""The hooks every connector must implement (the reference's seven abstract methods)."""

OPTIONAL_HOOKS: tuple[str, ...] = (
    "bind_gpu_block_pool",
    "bind_kv_cache_manager",
    "update_connector_output",
    "request_finished",
    "get_transfer_results",
    "take_events",
    "get_event_snapshot",
    "register_kv_caches",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "handle_preemptions",
    "forget_requests",
    "plan_failed",
    "build_connector_worker_meta",
    "reset_cache",
    "shutdown",
)
"""Hooks with a no-op default; a wrapper such as MultiConnector forwards all of them."""


class KVConnectorRole(enum.IntEnum):
    """Which side of the engine a connector instance serves."""

    SCHEDULER = 0
    """Runs in the scheduler: plans loads and saves, owns no KV tensors."""
    WORKER = 1
    """Runs next to the model: moves KV bytes in and out of the paged tensors."""


def _refuse_unsupported_groups(connector: KVConnectorBase_V1, kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse a one-group connector on a model with several KV cache groups.

    vLLM refuses a connector without hybrid support when its hybrid KV cache manager is
    on; doing the same here keeps a connector that only knows group 0 from loading the
    other groups' blocks wrongly (it would pass on one-group models and silently
    corrupt outputs on hybrid ones). Read on the instance, so a wrapper such as
    MultiConnector can declare it from its children.
    """
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) <= 1 or connector.supports_multiple_kv_cache_groups:
        return
    kinds = ", ".join(f"{i}: {g.kv_cache_spec.kind} x{len(g.layer_names)} layers"
                      for i, g in enumerate(groups))
    msg = (f"connector {connector.name or type(connector).__name__!r} handles one KV cache group "
           f"only, but the model has {len(groups)} ({kinds}); use a model with one group (e.g. "
           f"'tiny'), or declare supports_multiple_kv_cache_groups = True on the connector "
           f"once it loads and stores every group's blocks")
    raise ConfigError(msg)


class KVConnectorBase_V1(_SchedulerHooks, _WorkerHooks):  # noqa: N801 - vLLM's name, kept for portability
    """Base class of every KV connector.

    Subclass it, set :attr:`name`, implement the seven abstract hooks and
    override the optional ones you need. The framework creates one instance per
    role with ``cls(config, role, kv_cache_config)``; an instance only ever gets
    the hooks of its role.

    **Scheduler-side hooks, in the order a request meets them:**

    1. ``bind_gpu_block_pool(pool)`` once, right after the KV cache manager exists.
    2. ``get_num_new_matched_tokens(request, num_computed_tokens)`` when a
       waiting request is considered for admission (possibly several times).
    3. ``update_state_after_alloc(request, blocks, num_external_tokens)`` after
       every successful admission allocation (0 external tokens included).
    4. ``build_connector_meta(scheduler_output)`` at the end of every schedule
       step, empty steps included.
    5. ``update_connector_output(output)`` with the worker's report of the step.
    6. ``request_finished(request, block_ids)`` exactly once per request,
       before its blocks are freed.
    7. ``take_events()`` whenever the engine publishes KV events;
       ``get_event_snapshot()`` instead, when ``take_events`` raised (the events
       it drained are lost, so consumers are resynced from a snapshot).

    **Worker-side hooks, per step, in this order** (the same order runs with no
    forward on an empty step): ``bind_connector_metadata`` -> ``start_load_kv``
    (before the forward when the step has synchronous loads, else right after
    it is launched) -> per attention layer ``wait_for_layer_load`` /
    ``save_kv_layer`` -> ``wait_for_save`` -> ``get_transfer_results`` (whose
    default wraps ``get_finished``) ->
    ``get_block_ids_with_load_errors`` -> ``get_kv_connector_stats`` ->
    ``build_connector_worker_meta`` -> ``clear_connector_metadata``;
    ``handle_preemptions`` runs right after ``bind_connector_metadata`` in
    kvconnector's engine and right *before* it inside vLLM, so it must use the
    plan it is given, not the bound one. ``register_kv_caches`` runs once, after
    the KV tensors are allocated; ``shutdown`` once at the end (both roles).

    **Empty steps.** An engine may run a step that schedules nothing: after a
    request finishes (once, so the worker learns ``finished_req_ids``), while
    delayed frees wait for ``finished_sending``, while asynchronous loads are in
    flight, or while admission is blocked. Every hook of a step runs on it
    (``build_connector_meta``, the worker sequence without a forward, stats,
    ``take_events``). An empty step alone is not a sign of starvation.

    The hooks of each role are written in a private mixin beside this module
    (``_scheduler_hooks``, ``_worker_hooks``); this class is the one to subclass.

    **Capabilities** are the class attributes below; keep them truthful, the
    engine and the test kit rely on them.

    Attributes:
        name: the name the registry knows the connector by (required, unique).
        aliases: other names accepted by the registry and configs.
        metadata_type: the :class:`KVConnectorMetadata` subclass returned by
            ``build_connector_meta``; wrappers use it to decode the plan.
        supports_async_load: ``get_num_new_matched_tokens`` may answer
            ``load_async=True`` (the request then waits in
            WAITING_FOR_REMOTE_KVS until ``finished_recving`` reports it). A
            declaration: the engine goes by each answer, and ``DataCheck`` reports an
            async answer from a connector that does not declare it.
        has_sync_kv_loads: run ``start_load_kv`` before the forward in *every*
            step. Not needed for synchronous loads: the scheduler sets
            ``SchedulerOutput.has_sync_kv_loads`` in each step where some request
            loads synchronously (vLLM 0.33 does the same and has no such class
            attribute), and the worker then starts loads before the forward. Leave it
            False unless ``start_load_kv`` must always precede the forward.
        requires_block_pool: the connector does nothing useful without
            ``bind_gpu_block_pool`` (e.g. it pins GPU blocks); engines without a
            block pool must refuse it.
        required_kv_cache_layout: the KV tensor layout the connector wants from
            engines that offer several (vLLM's names, e.g. ``"LBHNC"``), or
            None for any; the vLLM adapter answers vLLM's
            ``get_required_kvcache_layout`` with it.
        supports_multiple_kv_cache_groups: the connector handles models with
            several KV cache groups (hybrid models); the vLLM adapter enables
            vLLM's hybrid KV cache manager only for such connectors, and the
            constructor refuses any other connector on such a model (ConfigError).
            Read on the instance, so a wrapper may set it from what it wraps before
            calling ``super().__init__``.
        settings_type: the connector's settings, a
            :class:`~kvconnector_core.connector.settings.ConnectorSettings` Struct;
            ``extra_config`` is converted to it on creation (unknown keys and bad
            values are ConfigErrors naming the connector and the key) and kept in
            :attr:`settings`. None: ``extra_config`` is passed through unchecked.
        uses_layer_hooks: the worker side does something in ``wait_for_layer_load`` /
            ``save_kv_layer``. False lets the engine skip the two calls per layer per
            step (a connector that moves whole blocks once per step declares it).
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    metadata_type: ClassVar[type[KVConnectorMetadata]] = KVConnectorMetadata
    supports_async_load: ClassVar[bool] = False
    has_sync_kv_loads: ClassVar[bool] = False
    requires_block_pool: ClassVar[bool] = False
    required_kv_cache_layout: ClassVar[str | None] = None
    supports_multiple_kv_cache_groups: ClassVar[bool] = False
    settings_type: ClassVar[type[Any] | None] = None
    uses_layer_hooks: ClassVar[bool] = True

    def __init__(
        self,
        config: KVConnectorConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        """Create the connector for one role.

        Args:
            config: the connector config (``extra_config`` holds its settings).
            role: :attr:`KVConnectorRole.SCHEDULER` or :attr:`KVConnectorRole.WORKER`.
            kv_cache_config: the engine's KV cache layout (block counts and
                groups); None only in unit tests that do not need it.

        Raises:
            ConfigError: ``config`` is not a :class:`KVConnectorConfig`,
                ``role`` is not a :class:`KVConnectorRole`, ``extra_config``
                does not convert to :attr:`settings_type`, or ``kv_cache_config``
                has several KV cache groups (a hybrid model) and the connector
                does not declare :attr:`supports_multiple_kv_cache_groups`.
        """
        if not isinstance(config, KVConnectorConfig):
            msg = (
                f"{type(self).__name__} needs a KVConnectorConfig, got "
                f"{type(config).__qualname__}: {config!r}"
            )
            raise ConfigError(msg)
        try:
            role = KVConnectorRole(role)
        except ValueError:
            msg = (
                f"{type(self).__name__}: role must be KVConnectorRole.SCHEDULER (0) "
                f"or KVConnectorRole.WORKER (1), got {role!r}"
            )
            raise ConfigError(msg) from None
        _refuse_unsupported_groups(self, kv_cache_config)
        self._config = config
        self._role = role
        self._kv_cache_config = kv_cache_config
        self._connector_metadata: KVConnectorMetadata | None = None
        self._kv_cache_manager: KVCacheManager | None = None
        self._settings: Any = None
        if self.settings_type is not None:
            from kvconnector_core.connector.settings import convert_settings

            self._settings = convert_settings(self.name or type(self).__name__, self.settings_type,
                                              config.extra_config)

    @classmethod
    def demo_extra_config(cls, options: DemoOptions) -> dict[str, Any]:
        """Settings for a demo run (``kvconnector run --connector NAME``) with no config file.

        Override it to size a tier against the run's GPU pool or to honour the run's
        optional options; refuse those it cannot honour with ``options.refuse(...)``.

        Args:
            options: the run's options (see
                :class:`~kvconnector_core.connector.demo.DemoOptions`).

        Returns:
            An ``extra_config``. Default: ``{}`` (the connector's defaults).

        Raises:
            ConfigError: an optional option is set (the default honours none).
        """
        options.refuse()
        return {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} role={self._role.name}>"

    # ------------------------------------------------------------------ common

    @property
    def role(self) -> KVConnectorRole:
        """The role this instance was created for."""
        return self._role

    @property
    def config(self) -> KVConnectorConfig:
        """The config this instance was created with."""
        return self._config

    @property
    def settings(self) -> Any:
        """``extra_config`` converted to :attr:`settings_type` (None without one)."""
        return self._settings

    @property
    def kv_cache_config(self) -> KVCacheConfig | None:
        """The engine's KV cache layout, as given to the constructor."""
        return self._kv_cache_config

    def shutdown(self) -> None:
        """Release resources (threads, buffers, pins). Both roles; default: nothing.

        Called once when the engine stops; must be safe to call again.
        """

    def has_pending_work(self) -> bool:
        """Whether the connector still has something to send or learn in a later step
        (either role, optional): a message for the other side it could not deliver yet,
        saves still being copied. While it is True the engine keeps stepping (empty
        steps) after its last request finished, so nothing is left half-done when it
        goes idle. Bounded by the guard. Default: False.
        """
        return False

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Return the statistics since the previous call, or None when there is nothing to report.

        Called once per step on both sides, empty steps included. Numbers are
        **deltas** since the previous call (counters), so an engine sums them
        per interval; levels (gauges, e.g. blocks currently pinned) go under the
        key ``"gauges"`` as a ``{name: number}`` dict, of which an engine keeps
        the latest value instead of summing. Standard keys the engine
        aggregates: ``bytes_loaded``, ``bytes_stored``, ``load_seconds``,
        ``store_seconds``; any other keys are reported as is. Default: None.
        """
        return None

    def reset_cache(self) -> bool | None:
        """Drop cached KV and release every GPU block held (pins); scheduler side, optional.

        Engines call it **before** resetting the GPU prefix cache (kvconnector's
        ``Scheduler.reset_prefix_cache``; inside vLLM the adapter calls it
        before vLLM's block pool reset, and vLLM calls it again after), so a
        connector holding pins never makes the reset fail. Must be idempotent.

        Returns:
            False when the connector could not reset; None or True otherwise.
            Default: None (nothing to reset).
        """
        return None


KVConnectorBase = KVConnectorBase_V1
"""Short name of :class:`KVConnectorBase_V1`."""
