"""The connector API: base class, records, config, guard; and the registry's names.

- :mod:`~kvconnector_core.connector.base`: :class:`KVConnectorBase_V1`
  (alias ``KVConnectorBase``), :class:`KVConnectorRole`, and a connector as two role
  objects: :class:`KVConnectorSchedulerSide`, :class:`KVConnectorWorkerSide`,
  :class:`RoleSplitConnector`.
- :mod:`~kvconnector_core.connector.metadata`: :class:`KVConnectorMetadata`
  (scheduler -> worker), :class:`KVConnectorOutput` (worker -> scheduler).
- :mod:`~kvconnector_core.connector.config`: :class:`KVConnectorConfig`.
- :mod:`~kvconnector_core.connector.settings`: :class:`ConnectorSettings`, a connector's
  typed ``extra_config``.
- :mod:`~kvconnector_core.connector.guard`: :class:`GuardedScheduler`,
  :class:`GuardedWorker` (the failure contract; ``docs/failure-contract.md``).

The plugin machinery (:class:`ConnectorRegistry`, :func:`get_registry`,
:func:`create_connector`, :data:`hookimpl`, ...) lives in :mod:`kvconnector_core.plugins`;
its public names are exported here too, since a connector author imports the whole
API from this package.

Importing this package loads no plugin and does not import torch.
"""

from __future__ import annotations

from kvconnector_core.connector.base import (
    ABSTRACT_HOOKS,
    OPTIONAL_HOOKS,
    KVConnectorBase,
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorSchedulerSide,
    KVConnectorWorkerSide,
    RoleSplitConnector,
)
from kvconnector_core.connector.config import (
    KV_ROLES,
    LOAD_FAILURE_POLICIES,
    KVConnectorConfig,
    load_connector_config,
)
from kvconnector_core.connector.guard import GuardedScheduler, GuardedWorker
from kvconnector_core.connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorTransferResults,
    WireKVCacheEvent,
    check_metadata_roundtrip,
    decode_metadata,
    encode_metadata,
)
from kvconnector_core.plugins import (
    ConnectorEntry,
    ConnectorRegistry,
    PluginFailure,
    PluginRecord,
    create_connector,
    get_connector_class,
    get_registry,
    hookimpl,
    reset_registry,
)

__all__ = [
    "ABSTRACT_HOOKS",
    "KV_ROLES",
    "LOAD_FAILURE_POLICIES",
    "OPTIONAL_HOOKS",
    "ConnectorEntry",
    "ConnectorRegistry",
    "GuardedScheduler",
    "GuardedWorker",
    "KVConnectorBase",
    "KVConnectorBase_V1",
    "KVConnectorConfig",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorSchedulerSide",
    "KVConnectorTransferResults",
    "KVConnectorWorkerSide",
    "PluginFailure",
    "PluginRecord",
    "RoleSplitConnector",
    "WireKVCacheEvent",
    "check_metadata_roundtrip",
    "create_connector",
    "decode_metadata",
    "encode_metadata",
    "get_connector_class",
    "get_registry",
    "hookimpl",
    "load_connector_config",
    "reset_registry",
]
