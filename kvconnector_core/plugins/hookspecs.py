"""The kvconnector plugin hooks (pluggy project ``kvconnector``).

A plugin is a module (or any object) with functions decorated by
:data:`hookimpl`, exposed through an entry point in group ``kvconnector``::

    # pyproject.toml of the plugin's distribution
    [project.entry-points.kvconnector]
    my_plugin = "my_package.plugin"

    # my_package/plugin.py
    from kvconnector_core.plugins import hookimpl  # or kvconnector_core.connector

    @hookimpl
    def kvconnector_register_connectors(registry):
        from my_package.connector import MyConnector   # import inside: no import-time work
        registry.add(MyConnector)

The built-in connectors register through the same hook (``connectors._plugin``).

Primitives: :data:`hookimpl`, :data:`hookspec`, :data:`PROJECT_NAME`,
:data:`CACHE_POLICY_GROUP`, :func:`kvconnector_register_connectors`,
:func:`kvconnector_register_cache_policies`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from kvconnector_core.plugins.registry import ConnectorRegistry

__all__ = [
    "CACHE_POLICY_GROUP",
    "PROJECT_NAME",
    "hookimpl",
    "hookspec",
    "kvconnector_register_cache_policies",
    "kvconnector_register_connectors",
]

PROJECT_NAME = "kvconnector"
"""The pluggy project name, which is also the entry-point group."""
CACHE_POLICY_GROUP = f"{PROJECT_NAME}.cache_policies"
"""Entry-point group of cache-policy plugins (see :func:`kvconnector_register_cache_policies`)."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""Marks hook specifications (framework use)."""

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Marks a plugin's hook implementations:
``@hookimpl def kvconnector_register_connectors(registry): ...``."""


@hookspec
def kvconnector_register_connectors(registry: ConnectorRegistry) -> None:
    """Register connector classes.

    Called once per plugin, the first time the default registry is needed
    (never at import time). Call ``registry.add(ConnectorClass)`` for each
    connector; the name comes from the class attribute ``name`` (and
    ``aliases``). Import your connector modules inside the hook, so that
    listing plugins stays cheap. Return nothing.

    Args:
        registry: the registry to add connector classes to.
    """


@hookspec
def kvconnector_register_cache_policies(registry: Any) -> None:
    """Register cache policies of the CPU offload tier (entry-point group
    ``kvconnector.cache_policies``).

    Call ``registry.add(name, PolicyClass)`` for each policy (a subclass of
    ``connectors.offload.manager.CachePolicy``, built as ``PolicyClass(capacity)``);
    users select it by ``cache_policy`` in the offload connector's settings. Return nothing.

    Args:
        registry: the cache-policy registry.
    """
