"""Plugin machinery: the connector registry and how plugins fill it.

- :mod:`~kvconnector_core.plugins.registry`: :class:`ConnectorRegistry` (names ->
  connector classes, loaded from entry points in group ``kvconnector``),
  :func:`get_registry`, :func:`reset_registry`, :func:`get_connector_class`,
  :func:`create_connector`.
- :mod:`~kvconnector_core.plugins.hookspecs`: the pluggy hook
  ``kvconnector_register_connectors(registry)`` and :data:`hookimpl` for plugins.
- :mod:`~kvconnector_core.plugins.records`: :class:`ConnectorEntry`,
  :class:`PluginRecord`, :class:`PluginFailure`.
- :mod:`~kvconnector_core.plugins.policy`: the allow/deny lists
  (``KVCONNECTOR_PLUGINS_ALLOW`` / ``KVCONNECTOR_PLUGINS_DENY``) and running plugin
  code so that whatever it raises is recorded, not fatal.

The public names are exported from :mod:`kvconnector_core.connector` and
:mod:`kvconnector_core` too. Importing this package loads no plugin and does not
import torch.
"""

from __future__ import annotations

from kvconnector_core.plugins.hookspecs import hookimpl
from kvconnector_core.plugins.records import ConnectorEntry, PluginFailure, PluginRecord
from kvconnector_core.plugins.registry import (
    ConnectorRegistry,
    create_connector,
    get_connector_class,
    get_registry,
    reset_registry,
)

__all__ = [
    "ConnectorEntry",
    "ConnectorRegistry",
    "PluginFailure",
    "PluginRecord",
    "create_connector",
    "get_connector_class",
    "get_registry",
    "hookimpl",
    "reset_registry",
]
