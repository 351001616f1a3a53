"""Typed settings of the kit's fault injection, and what it observed.

:class:`FaultSettings` is everything a
:class:`~kvconnector_core.testing.faults.FaultInjectingConnector` injects; :class:`HookFault`
says when one hook raises. Both are msgspec Structs, so they also load from a connector
config's ``extra_config`` (see :func:`~kvconnector_core.testing.faults.fault_injection_config`),
with errors that name the bad field. :class:`FailedStoreHit` records a lookup that claimed a
block whose store failed.

Primitives: :class:`HookFault`, :class:`FaultSettings`, :class:`FailedStoreHit`,
:data:`FAULT_HOOKS`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from kvconnector_core.connector.base import ABSTRACT_HOOKS, OPTIONAL_HOOKS
from kvconnector_core.errors import ConfigError

__all__ = ["FAULT_HOOKS", "FailedStoreHit", "FaultSettings", "HookFault", "hook_faults"]

FAULT_HOOKS: frozenset[str] = frozenset(
    (*ABSTRACT_HOOKS, *OPTIONAL_HOOKS, "bind_connector_metadata", "clear_connector_metadata")
    ) - {"bind_kv_cache_manager"}  # the kvconnector engine never calls it
"""Hook names a :class:`HookFault` may name: every hook of both roles."""


class HookFault(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """When one hook raises :class:`~kvconnector_core.testing.faults.InjectedFault`.

    A raising hook does not reach the wrapped connector (it raises instead of running).

    Attributes:
        hook: the hook's name (one of :data:`FAULT_HOOKS`).
        rate: probability that a call raises, in [0, 1]; 1 (the default) raises on
            every call. Ignored when ``at_step`` is set.
        at_step: raise exactly once, on the first call of the hook at or after this step
            (the scheduler side counts the plans it built, the worker side the plans
            bound, both from 0); None raises at ``rate``.
    """

    hook: str
    rate: float = 1.0
    at_step: int | None = None

    def __post_init__(self) -> None:
        if self.hook not in FAULT_HOOKS:
            msg = (f"HookFault hook={self.hook!r} is not a connector hook; "
                   f"valid: {sorted(FAULT_HOOKS)}")
            raise ConfigError(msg)
        if not 0.0 <= self.rate <= 1.0:
            msg = f"HookFault({self.hook}) rate={self.rate!r}; must be within [0, 1]"
            raise ConfigError(msg)
        if self.at_step is not None and self.at_step < 0:
            msg = f"HookFault({self.hook}) at_step={self.at_step!r}; must be >= 0 or None"
            raise ConfigError(msg)


def hook_faults(raise_in: Iterable[str | HookFault] | Mapping[str, float]) -> tuple[HookFault, ...]:
    """Normalise the accepted forms of ``raise_in`` to :class:`HookFault` records.

    Args:
        raise_in: hook names (raise on every call), ``{hook: rate}``, or records.

    Returns:
        One record per hook, in the order given.

    Raises:
        ConfigError: an unknown hook, a rate outside [0, 1], or a hook named twice.
    """
    if isinstance(raise_in, Mapping):
        faults = [HookFault(hook=h, rate=float(r)) for h, r in raise_in.items()]
    else:
        faults = [f if isinstance(f, HookFault) else _named(f) for f in raise_in]
    seen: set[str] = set()
    for fault in faults:
        if fault.hook in seen:
            msg = f"raise_in names hook {fault.hook!r} twice; give one HookFault per hook"
            raise ConfigError(msg)
        seen.add(fault.hook)
    return tuple(faults)


def _named(hook: str) -> HookFault:
    if hook not in FAULT_HOOKS:
        msg = (f"FaultInjectingConnector raise_in has unknown hooks [{hook!r}]; "
               f"valid: {sorted(FAULT_HOOKS)}")
        raise ConfigError(msg)
    return HookFault(hook=hook)


class FaultSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a fault-injecting wrapper injects (give both roles the same settings).

    Attributes:
        load_failure_rate: probability that a load the inner connector plans fails, in [0, 1].
        store_failure_rate: probability that a step's stores fail, in [0, 1].
        raise_in: hooks that raise, and when.
        completion_delay_steps: report each finished transfer (send or receive) up to this
            many steps late, a random delay per request, so completions also arrive out of
            order; 0 reports them as the inner connector does.
        seed: seed of the fault RNGs.
    """

    load_failure_rate: float = 0.0
    store_failure_rate: float = 0.0
    raise_in: tuple[HookFault, ...] = ()
    completion_delay_steps: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for label, rate in (("load_failure_rate", self.load_failure_rate),
                            ("store_failure_rate", self.store_failure_rate)):
            if not 0.0 <= rate <= 1.0:
                msg = f"FaultInjectingConnector {label}={rate!r}; must be within [0, 1]"
                raise ConfigError(msg)
        if self.completion_delay_steps < 0:
            msg = (f"FaultInjectingConnector completion_delay_steps="
                   f"{self.completion_delay_steps!r}; must be >= 0")
            raise ConfigError(msg)
        hook_faults(self.raise_in)  # a hook named twice

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FaultSettings:
        """Build settings from plain data (e.g. a connector's ``extra_config``).

        Raises:
            ConfigError: an unknown key or a value of the wrong type or range.
        """
        try:
            return msgspec.convert(dict(data), type=cls)
        except msgspec.ValidationError as exc:
            msg = f"invalid fault injection settings {dict(data)!r}: {exc}"
            raise ConfigError(msg) from exc


class FailedStoreHit(msgspec.Struct, frozen=True):
    """A lookup claimed blocks whose only stores failed (a contract violation).

    Attributes:
        request_id: the request looked up.
        step: the scheduler-side step of the lookup.
        block_indices: the request's block positions whose hashes were claimed.
    """

    request_id: str
    step: int
    block_indices: tuple[int, ...]
