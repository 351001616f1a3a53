"""Fault injection: wrap a connector so that loads and stores fail, hooks raise, and
completions arrive late.

:class:`FaultInjectingConnector` wraps one side of a connector; build one wrapper per side
with the same settings (:class:`~kvconnector_core.testing.fault_settings.FaultSettings`).
Faults are drawn from RNGs seeded with ``seed``, so a run is reproducible. To inject faults
into an engine (or into one child of a MultiConnector) from a config, wrap the connector's
config with :func:`fault_injection_config`.

- **Load failures** (``load_failure_rate``): the scheduler-side wrapper decides, per load
  the inner connector plans (``update_state_after_alloc`` with external tokens), whether it
  fails, and tells the worker-side wrapper in its metadata. The worker-side wrapper reports
  the load's blocks in ``get_block_ids_with_load_errors`` and, for an asynchronous load,
  the request as a failed receive (in ``finished_recving`` and ``failed_recving``), exactly
  as a connector whose transfer failed must. The inner connector still runs, so its data is
  ignored, never trusted.
- **Store failures** (``store_failure_rate``): per step, the scheduler-side wrapper decides
  whether the step's stores fail. The worker-side wrapper then raises
  :class:`InjectedFault` from ``wait_for_save`` (after the inner connector ran, so its
  bookkeeping of queued jobs and delayed frees stays whole): by the failure contract a
  raising save hook is a failed store, which must never become visible. The kit checks
  that: the scheduler-side wrapper records the hashes of the blocks a failed step completed
  and, when a later lookup (``get_num_new_matched_tokens``) claims one of them, records a
  :class:`~kvconnector_core.testing.fault_settings.FailedStoreHit` in
  :attr:`FaultInjectingConnector.failed_store_hits` (call
  :meth:`FaultInjectingConnector.check_failed_stores_invisible` to assert there are none).
  A hash that a later step without store failure completes again counts as stored.
- **Raising hooks** (``raise_in``): any hook of either role raises :class:`InjectedFault`
  instead of reaching the inner connector: on every call, at a rate per call, or once at
  a given step (:class:`~kvconnector_core.testing.fault_settings.HookFault`).
- **Late completions** (``completion_delay_steps``): each finished send or receive is
  reported up to that many steps late (a random delay per request, so also out of order);
  a failed load's block errors travel with its late receive.

``get_kv_connector_stats`` adds ``injected_faults`` (counts by kind) to the inner stats.

The hooks are written by role in private modules beside this one (``_fault_scheduler``,
``_fault_worker``, their shared state in ``_fault_base``).

Primitives: :class:`FaultInjectingConnector`, :class:`FaultInjector`,
:func:`fault_injection_config`, :class:`FaultMetadata`, :class:`InjectedFault`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from kvconnector_core.connector.base import KVConnectorBase_V1, KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.connector.metadata import KVConnectorMetadata
from kvconnector_core.errors import ConfigError
from kvconnector_core.testing._fault_base import FaultMetadata, InjectedFault
from kvconnector_core.testing._fault_scheduler import _SchedulerFaults
from kvconnector_core.testing._fault_worker import _WorkerFaults
from kvconnector_core.testing.fault_settings import (
    FAULT_HOOKS,
    FailedStoreHit,
    FaultSettings,
    HookFault,
    hook_faults,
)

if TYPE_CHECKING:
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
    from kvconnector_core.request import Request

__all__ = [
    "FAULT_HOOKS",
    "FaultInjectingConnector",
    "FaultInjector",
    "FaultMetadata",
    "InjectedFault",
    "fault_injection_config",
]


class FaultInjectingConnector(_SchedulerFaults, _WorkerFaults):
    """Wraps one side of a connector and injects faults; see the module docstring.

    Args:
        inner: the connector (one side) to wrap.
        load_failure_rate: see :class:`FaultSettings`.
        store_failure_rate: see :class:`FaultSettings`.
        raise_in: hooks that raise: names (every call), ``{name: rate}`` or
            :class:`HookFault` records.
        completion_delay_steps: see :class:`FaultSettings`.
        seed: seed of the fault RNGs.

    Raises:
        ConfigError: a rate outside [0, 1], an unknown hook name, a negative delay.
    """

    name: ClassVar[str] = "FaultInjectingConnector"
    metadata_type: ClassVar[type[KVConnectorMetadata]] = FaultMetadata

    def __init__(
        self,
        inner: KVConnectorBase_V1,
        *,
        load_failure_rate: float = 0.0,
        store_failure_rate: float = 0.0,
        raise_in: Iterable[str | HookFault] | Mapping[str, float] = (),
        completion_delay_steps: int = 0,
        seed: int = 0,
    ) -> None:
        # Before the base checks it: the wrapper handles the groups its inner connector handles.
        self.supports_multiple_kv_cache_groups = inner.supports_multiple_kv_cache_groups  # type: ignore[misc]
        super().__init__(inner.config, inner.role, inner.kv_cache_config)
        # Not ``settings``: the base class's name for a connector's typed extra_config.
        self.fault_settings = FaultSettings(
            load_failure_rate=load_failure_rate, store_failure_rate=store_failure_rate,
            raise_in=hook_faults(raise_in), completion_delay_steps=completion_delay_steps, seed=seed)
        self.inner = inner
        self.load_failure_rate = load_failure_rate
        self.store_failure_rate = store_failure_rate
        self._hook_faults = {f.hook: f for f in self.fault_settings.raise_in}
        self.raise_in = frozenset(self._hook_faults)
        # Separate streams, so adding a raising hook leaves the load/store pattern unchanged.
        self._rng = random.Random(seed)
        self._raise_rng = random.Random(f"{seed}:raise")
        self._delay_rng = random.Random(f"{seed}:delay")
        # The wrapper's capability ClassVars are per instance: it mirrors what it wraps.
        self.supports_async_load = inner.supports_async_load  # type: ignore[misc]  # ClassVar set per instance
        self.has_sync_kv_loads = inner.has_sync_kv_loads  # type: ignore[misc]  # ClassVar set per instance
        self.requires_block_pool = inner.requires_block_pool  # type: ignore[misc]  # ClassVar set per instance
        self._step = 0
        self._raised_once: set[str] = set()
        # scheduler side
        self._requests: dict[str, Request] = {}
        self._lookups: dict[str, tuple[int, bool]] = {}  # req -> (local hit, async)
        self._step_failed: dict[str, tuple[list[int], bool]] = {}
        self._failed_hashes: set[bytes] = set()
        self._good_hashes: set[bytes] = set()
        self._completed: dict[int, set[bytes]] = {}  # step -> hashes first marked stored by it
        self.failed_store_hits: list[FailedStoreHit] = []
        """Lookups that claimed blocks whose stores failed (should stay empty)."""
        # worker side
        self._invalid: set[int] = set()
        self._async_invalid: dict[str, list[int]] = {}
        self._failed_recv: set[str] = set()
        self._suppressed_recv: set[str] = set()
        self._late: list[tuple[int, str, str, bool]] = []  # (due step, "send"/"recv", req, failed)
        self._fail_stores = False
        self.num_injected = {"loads": 0, "stores": 0, "raises": 0, "late": 0}
        """How many faults were injected, by kind."""
        self.num_injected_raises = 0
        """How many times a hook raised InjectedFault on purpose (failed stores included,
        which raise from ``wait_for_save``); the engine's guard counts each one as an error."""

    def __repr__(self) -> str:
        return f"<FaultInjectingConnector inner={self.inner!r}>"



class FaultInjector(FaultInjectingConnector):
    """A :class:`FaultInjectingConnector` built from a connector config (see
    :func:`fault_injection_config`): ``extra_config`` holds ``inner`` (the wrapped
    connector's config, a dict) and the fields of :class:`FaultSettings`.

    Raises:
        ConfigError: invalid settings or inner config; RegistryError: unknown inner name.
    """

    name: ClassVar[str] = "FaultInjector"

    def __init__(self, config: KVConnectorConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        from kvconnector_core.connector.registry import create_connector

        extra = dict(config.extra_config)
        if "inner" not in extra:
            msg = "FaultInjector needs extra_config['inner'], the config of the connector to wrap"
            raise ConfigError(msg)
        inner = create_connector(KVConnectorConfig.from_dict(extra.pop("inner")), role, kv_cache_config)
        s = FaultSettings.from_dict(extra)
        super().__init__(inner, load_failure_rate=s.load_failure_rate, store_failure_rate=s.store_failure_rate,
                         raise_in=s.raise_in, completion_delay_steps=s.completion_delay_steps, seed=s.seed)


def fault_injection_config(inner: KVConnectorConfig | Mapping[str, Any],
                           settings: FaultSettings | None = None) -> KVConnectorConfig:
    """A connector config that creates ``inner`` wrapped in a :class:`FaultInjector`.

    Use it wherever a config goes: ``EngineConfig(connector=...)`` or a child of a
    MultiConnector. Role and load-failure policy are the inner config's.

    Args:
        inner: the wrapped connector's config.
        settings: the faults (default: none).

    Returns:
        The wrapping config.
    """
    inner_cfg = KVConnectorConfig.from_dict(dict(inner) if isinstance(inner, Mapping) else inner)
    extra = {"inner": inner_cfg.to_dict(), **msgspec.to_builtins(settings or FaultSettings())}
    return KVConnectorConfig(name=FaultInjector.name, module_path=__name__, extra_config=extra,
                             role=inner_cfg.role, load_failure_policy=inner_cfg.load_failure_policy)
