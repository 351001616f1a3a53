"""The connector test kit: fixtures, a contract every connector must pass, fault injection.

- :class:`ConnectorContract`: subclass it with ``connector_config = ...``.
- :class:`FaultInjectingConnector`: make loads or stores fail, hooks raise, completions come
  late; :func:`fault_injection_config` wraps a connector config with it.
- :class:`RecordingConnector`: a scriptable test double that records hook calls.
- factories (also fixtures through the pytest plugin ``kvconnector_core.testing.plugin``):
  :func:`make_kv_cache_config`, :func:`make_block_pool`, :func:`make_kv_cache_manager`,
  :func:`make_request`, :func:`make_connector_pair`, :func:`make_kv_caches`,
  :func:`empty_scheduler_output`, :func:`scheduler_output_for`.
"""

from __future__ import annotations

from kvconnector_core.testing.contract import ConnectorContract
from kvconnector_core.testing.factories import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    empty_scheduler_output,
    make_block_pool,
    make_connector_pair,
    make_kv_cache_config,
    make_kv_cache_manager,
    make_kv_caches,
    make_request,
    scheduler_output_for,
)
from kvconnector_core.testing.fault_settings import FailedStoreHit, FaultSettings, HookFault
from kvconnector_core.testing.faults import (
    FaultInjectingConnector,
    FaultInjector,
    FaultMetadata,
    InjectedFault,
    fault_injection_config,
)
from kvconnector_core.testing.recording import RecordingConnector, RecordingMetadata

__all__ = [
    "BLOCK_SIZE",
    "NUM_BLOCKS",
    "ConnectorContract",
    "FailedStoreHit",
    "FaultInjectingConnector",
    "FaultInjector",
    "FaultMetadata",
    "FaultSettings",
    "HookFault",
    "InjectedFault",
    "RecordingConnector",
    "RecordingMetadata",
    "empty_scheduler_output",
    "fault_injection_config",
    "make_block_pool",
    "make_connector_pair",
    "make_kv_cache_config",
    "make_kv_cache_manager",
    "make_kv_caches",
    "make_request",
    "scheduler_output_for",
]
