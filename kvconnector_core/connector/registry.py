"""Old home of the connector registry; it lives in :mod:`kvconnector_core.plugins`."""

# compat: removed after the restructure merge
from __future__ import annotations

from kvconnector_core.plugins.policy import ENV_PLUGINS_ALLOW, ENV_PLUGINS_DENY
from kvconnector_core.plugins.records import ConnectorEntry, PluginFailure, PluginRecord
from kvconnector_core.plugins.registry import (
    BUILTIN_PLUGIN_MODULE,
    BUILTIN_PLUGIN_NAME,
    ENTRY_POINT_GROUP,
    ConnectorRegistry,
    create_connector,
    get_connector_class,
    get_registry,
    reset_registry,
)

__all__ = [
    "BUILTIN_PLUGIN_MODULE",
    "BUILTIN_PLUGIN_NAME",
    "ENTRY_POINT_GROUP",
    "ENV_PLUGINS_ALLOW",
    "ENV_PLUGINS_DENY",
    "ConnectorEntry",
    "ConnectorRegistry",
    "PluginFailure",
    "PluginRecord",
    "create_connector",
    "get_connector_class",
    "get_registry",
    "reset_registry",
]
