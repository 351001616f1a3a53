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
:func:`kvconnector_register_connectors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from kvconnector_core.plugins.registry import ConnectorRegistry

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec", "kvconnector_register_connectors"]

PROJECT_NAME = "kvconnector"
"""The pluggy project name, which is also the entry-point group."""

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
