"""Registry of the CPU offloading tier's cache policies by name (``cache_policy``).

Policies come from plugins: a module with ``@hookimpl def
kvconnector_register_cache_policies(registry)`` (see
:func:`kvconnector_core.plugins.hookspecs.kvconnector_register_cache_policies`), named by
an entry point in group ``kvconnector.cache_policies``. The built-ins, ``"lru"``
(:class:`~connectors.offload.manager.lru.LRUCachePolicy`) and ``"arc"``
(:class:`~connectors.offload.manager.arc.ARCCachePolicy`), register through the same hook:
this module is their plugin. Plugins load once, the first time a name is looked up. A
plugin that fails to import, has invalid hooks, raises, or registers something that is
not a policy is isolated: none of its policies register, the failure is kept
(:func:`policy_plugin_errors`, shown by ``kvconnector list``), and the others load.
:func:`register_cache_policy` adds a policy in process.

Primitives: :class:`PolicyRegistry`, :class:`PolicyPluginError`,
:func:`register_cache_policy`, :func:`get_cache_policy`, :func:`available_cache_policies`,
:func:`load_policy_plugins`, :func:`policy_plugin_errors`.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from connectors.offload.manager.arc import ARCCachePolicy
from connectors.offload.manager.lru import LRUCachePolicy
from connectors.offload.manager.policy import CachePolicy
from kvconnector_core._suggest import did_you_mean
from kvconnector_core.errors import ConfigError
from kvconnector_core.plugins import hookspecs
from kvconnector_core.plugins.hookspecs import CACHE_POLICY_GROUP, hookimpl

__all__ = [
    "PolicyPluginError",
    "PolicyRegistry",
    "available_cache_policies",
    "get_cache_policy",
    "kvconnector_register_cache_policies",
    "load_policy_plugins",
    "policy_plugin_errors",
    "policy_sources",
    "register_cache_policy",
]

_POLICIES: dict[str, type[CachePolicy]] = {}
_SOURCES: dict[str, str] = {}
_ERRORS: list[PolicyPluginError] = []
_loaded = False


@dataclass(frozen=True, slots=True)
class PolicyPluginError:
    """A cache-policy plugin that could not register.

    Attributes:
        plugin: its entry-point name (``"builtin"`` for this module).
        value: what the entry point names (``module`` or ``module:attr``).
        error: why, one line.
    """

    plugin: str
    value: str
    error: str


class PolicyRegistry:
    """What a plugin's hook receives: collects its policies, committed only if the
    whole hook succeeds."""

    def __init__(self) -> None:
        self.added: dict[str, type[CachePolicy]] = {}

    def add(self, name: str, cls: type[CachePolicy]) -> None:
        """Offer ``cls`` under ``name`` (case-insensitive).

        Raises:
            ConfigError: ``cls`` is not a CachePolicy subclass.
        """
        _check_class(name, cls)
        self.added[name.lower()] = cls


def _check_class(name: str, cls: object) -> None:
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        msg = f"cache policy {name!r}: {cls!r} is not a subclass of CachePolicy"
        raise ConfigError(msg)


def register_cache_policy(name: str, cls: type[CachePolicy], source: str = "in-process"
                          ) -> None:
    """Make a cache policy available under ``name`` (case-insensitive).

    Args:
        name: the value users give as ``cache_policy``.
        cls: a :class:`CachePolicy` subclass, constructed as ``cls(capacity)``.
        source: where it comes from (a plugin's name), shown by ``kvconnector list``.

    Raises:
        ConfigError: ``cls`` is not a CachePolicy subclass, or ``name`` is already
            taken by a different class.
    """
    _check_class(name, cls)
    key = name.lower()
    existing = _POLICIES.get(key)
    if existing is not None and existing is not cls:
        msg = (
            f"cache policy {name!r} is already registered to "
            f"{existing.__module__}.{existing.__qualname__}; cannot register "
            f"{cls.__module__}.{cls.__qualname__}"
        )
        raise ConfigError(msg)
    _POLICIES[key] = cls
    _SOURCES.setdefault(key, source)


@hookimpl
def kvconnector_register_cache_policies(registry: PolicyRegistry) -> None:
    """The built-in policies' plugin: ``lru`` and ``arc``."""
    registry.add("lru", LRUCachePolicy)
    registry.add("arc", ARCCachePolicy)


def _run_plugin(name: str, value: str, load: Any, pm: pluggy.PluginManager) -> None:
    """Load one plugin and commit what its hook registers, or record why not."""
    try:
        obj = load()
        if not pm.is_registered(obj):
            pm.register(obj, name=f"{name}:{value}")
        impls = [i for i in pm.hook.kvconnector_register_cache_policies.get_hookimpls()
                 if i.plugin is obj]
        if not impls:
            msg = "defines no @hookimpl kvconnector_register_cache_policies(registry)"
            raise ConfigError(msg)
        staged = PolicyRegistry()
        for impl in impls:
            impl.function(registry=staged)
        for policy, cls in staged.added.items():
            register_cache_policy(policy, cls, source=name)
    except Exception as exc:  # noqa: BLE001 - a broken plugin must not take the others down
        _ERRORS.append(PolicyPluginError(name, value, f"{type(exc).__name__}: {exc}"))


def load_policy_plugins(entry_points: Iterable[importlib.metadata.EntryPoint] | None = None
                        ) -> None:
    """Register the built-in policies, then every plugin of ``kvconnector.cache_policies``.

    Args:
        entry_points: the plugins to load; default: those installed.
    """
    global _loaded
    _loaded = True
    if entry_points is None:
        entry_points = importlib.metadata.entry_points(group=CACHE_POLICY_GROUP)
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    _run_plugin("builtin", __name__, lambda: sys.modules[__name__], pm)
    seen: set[tuple[str, str]] = set()
    for ep in sorted(entry_points, key=lambda e: e.name):
        if (ep.name, ep.value) not in seen:  # an editable install may list one twice
            seen.add((ep.name, ep.value))
            _run_plugin(ep.name, ep.value, ep.load, pm)


def _ensure_loaded() -> None:
    if not _loaded:
        load_policy_plugins()


def policy_plugin_errors() -> list[PolicyPluginError]:
    """The cache-policy plugins that failed to register (loading them first)."""
    _ensure_loaded()
    return list(_ERRORS)


def policy_sources() -> dict[str, str]:
    """Each registered policy name -> the plugin that registered it."""
    _ensure_loaded()
    return {name: _SOURCES.get(name, "in-process") for name in sorted(_POLICIES)}


def available_cache_policies() -> list[str]:
    """Return the registered policy names, sorted."""
    _ensure_loaded()
    return sorted(_POLICIES)


def get_cache_policy(name: str) -> type[CachePolicy]:
    """Return the policy class registered under ``name`` (case-insensitive).

    Raises:
        ConfigError: no policy of that name; the message names the nearest one and
            lists the known ones.
    """
    _ensure_loaded()
    cls = _POLICIES.get(str(name).lower())
    if cls is None:
        known = available_cache_policies()
        hint = did_you_mean(str(name), known)
        msg = (f"unknown cache policy {name!r}{hint}; known policies: "
               f"{', '.join(repr(p) for p in known)}")
        raise ConfigError(msg)
    return cls
