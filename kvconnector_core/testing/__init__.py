"""The connector test kit: fixtures, a contract every connector must pass, fault injection.

- :class:`ConnectorContract`: subclass it with ``connector_config = ...``.
- :class:`DataCheck`: subclass it the same way; runs the engine with and without the
  connector on small workloads and compares outputs and KV data block by block
  (:func:`run_data_check`, :func:`run_failed_load_check`, :func:`data_check_workloads`
  without pytest).
- :class:`FaultInjectingConnector`: make loads or stores fail, hooks raise, completions come
  late; :func:`fault_injection_config` wraps a connector config with it.
- :class:`RecordingConnector`: a scriptable test double that records hook calls.
- :data:`WORKER_STEP_HOOKS` / :func:`check_hook_order`: the reference worker hook order.
- factories (also fixtures through the pytest plugin ``kvconnector_core.testing.plugin``):
  :func:`make_kv_cache_config`, :func:`make_block_pool`, :func:`make_kv_cache_manager`,
  :func:`make_request`, :func:`make_connector_pair`, :func:`make_kv_caches`,
  :func:`empty_scheduler_output`, :func:`scheduler_output_for`.
"""

from __future__ import annotations

from kvconnector_core.testing.contract import ConnectorContract
from kvconnector_core.testing.data_check import (
    DataCheck,
    DataCheckReport,
    DataCheckWorkload,
    data_check_workloads,
    run_data_check,
    run_failed_load_check,
)
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
from kvconnector_core.testing.hook_order import WORKER_STEP_HOOKS, check_hook_order
from kvconnector_core.testing.recording import RecordingConnector, RecordingMetadata

__all__ = [
    "BLOCK_SIZE",
    "NUM_BLOCKS",
    "WORKER_STEP_HOOKS",
    "ConnectorContract",
    "DataCheck",
    "DataCheckReport",
    "DataCheckWorkload",
    "FailedStoreHit",
    "FaultInjectingConnector",
    "FaultInjector",
    "FaultMetadata",
    "FaultSettings",
    "HookFault",
    "InjectedFault",
    "RecordingConnector",
    "RecordingMetadata",
    "check_hook_order",
    "data_check_workloads",
    "empty_scheduler_output",
    "fault_injection_config",
    "make_block_pool",
    "make_connector_pair",
    "make_kv_cache_config",
    "make_kv_cache_manager",
    "make_kv_caches",
    "make_request",
    "run_data_check",
    "run_failed_load_check",
    "scheduler_output_for",
]
