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

Every name loads on first use: the kit's modules import torch and the engine, and the
pytest plugin (``kvconnector_core.testing.plugin``) is loaded in every pytest session of an
environment with kvconnector installed, which must stay cheap (and must not import torch
before the session's warning filters apply).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvconnector_core._lazy import lazy_exports

if TYPE_CHECKING:
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

# name -> defining submodule, imported on first use.
_LAZY = {
    "BLOCK_SIZE": "factories",
    "ConnectorContract": "contract",
    "DataCheck": "data_check",
    "DataCheckReport": "data_check",
    "DataCheckWorkload": "data_check",
    "FailedStoreHit": "fault_settings",
    "FaultInjectingConnector": "faults",
    "FaultInjector": "faults",
    "FaultMetadata": "faults",
    "FaultSettings": "fault_settings",
    "HookFault": "fault_settings",
    "InjectedFault": "faults",
    "NUM_BLOCKS": "factories",
    "RecordingConnector": "recording",
    "RecordingMetadata": "recording",
    "WORKER_STEP_HOOKS": "hook_order",
    "check_hook_order": "hook_order",
    "data_check_workloads": "data_check",
    "empty_scheduler_output": "factories",
    "fault_injection_config": "faults",
    "make_block_pool": "factories",
    "make_connector_pair": "factories",
    "make_kv_cache_config": "factories",
    "make_kv_cache_manager": "factories",
    "make_kv_caches": "factories",
    "make_request": "factories",
    "run_data_check": "data_check",
    "run_failed_load_check": "data_check",
    "scheduler_output_for": "factories",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
