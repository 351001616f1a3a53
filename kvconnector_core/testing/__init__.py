"""The connector test kit: fixtures, a contract every connector must pass, fault injection.

- :class:`ConnectorContract`: subclass it with ``connector_config = ...``.
- :class:`FaultInjectingConnector`: make loads or stores fail, or hooks raise.
- :class:`RecordingConnector`: a scriptable test double that records hook calls.
- :data:`WORKER_STEP_HOOKS` / :func:`check_hook_order`: the reference worker hook order.
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
from kvconnector_core.testing.faults import FaultInjectingConnector, FaultMetadata, InjectedFault
from kvconnector_core.testing.hook_order import WORKER_STEP_HOOKS, check_hook_order
from kvconnector_core.testing.recording import RecordingConnector, RecordingMetadata

__all__ = [
    "BLOCK_SIZE",
    "NUM_BLOCKS",
    "WORKER_STEP_HOOKS",
    "ConnectorContract",
    "FaultInjectingConnector",
    "FaultMetadata",
    "InjectedFault",
    "RecordingConnector",
    "RecordingMetadata",
    "check_hook_order",
    "empty_scheduler_output",
    "make_block_pool",
    "make_connector_pair",
    "make_kv_cache_config",
    "make_kv_cache_manager",
    "make_kv_caches",
    "make_request",
    "scheduler_output_for",
]
