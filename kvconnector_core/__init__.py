"""kvconnector: a KV-cache connector plugin framework for LLM serving.

This namespace is the curated public API: what a connector author or a user of the
engine needs, re-exported from the modules that define it (tests/plugins/test_public_api.py pins
the set). The engine's internals (block pool, coordinators, per-type managers, the
scheduler) stay importable from their modules but are not part of it.

- Errors: :class:`KVConnectorError` and its subclasses (``kvconnector_core.errors``).
- Writing a connector: :class:`KVConnectorBase_V1` (or the role objects
  :class:`KVConnectorSchedulerSide` / :class:`KVConnectorWorkerSide` behind a
  :class:`RoleSplitConnector`), :class:`KVConnectorMetadata`, :class:`ConnectorSettings`,
  :class:`StorePlanner`, :data:`hookimpl`; the objects hooks receive (:class:`Request`,
  :class:`KVCacheBlocks`, :class:`SchedulerOutput`, :class:`GPUBlockPoolView`, the KV
  cache specs); block hashes (:data:`BlockHash`, a ``NewType`` of ``bytes``) and KV events.
- Finding connectors: :func:`create_connector`, :func:`get_registry`.
- Running the engine: :class:`Engine`, :class:`EngineConfig`, workloads and models.

Names whose modules import torch (the engine, workloads, models) load on first use, so
``import kvconnector_core`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvconnector_core._lazy import lazy_exports
from kvconnector_core.connector import (
    ConnectorEntry,
    ConnectorRegistry,
    KVConnectorBase,
    KVConnectorBase_V1,
    KVConnectorConfig,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorSchedulerSide,
    KVConnectorTransferResults,
    KVConnectorWorkerSide,
    PluginFailure,
    PluginRecord,
    RoleSplitConnector,
    check_metadata_roundtrip,
    create_connector,
    get_connector_class,
    get_registry,
    hookimpl,
    load_connector_config,
    reset_registry,
)
from kvconnector_core.connector.planning import StorePlanner
from kvconnector_core.connector.settings import ConnectorSettings
from kvconnector_core.errors import (
    BlockSizeError,
    ConfigError,
    ConnectorHookError,
    DuplicateConnectorError,
    InvalidConnectorError,
    InvariantError,
    KVConnectorError,
    NoFreeBlocksError,
    PluginDeniedError,
    PluginLoadError,
    RegistryError,
    ShutdownError,
    TransferError,
    UnknownConnectorError,
)
from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView, KVCacheBlock
from kvconnector_core.kv_cache.hashing import (
    NONE_HASH,
    BlockHash,
    BlockHashWithGroupId,
    get_block_hash,
    get_group_id,
    hash_block_tokens,
    hash_request_tokens,
    make_block_hash_with_group_id,
)
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
from kvconnector_core.kv_cache.kv_cache_spec import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from kvconnector_core.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
    KVEventBatch,
    decode_event_batch,
    encode_event_batch,
    to_external_hash,
)
from kvconnector_core.request import Request, RequestStatus, lora_name_of
from kvconnector_core.scheduler.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
    yield_req_data,
)

if TYPE_CHECKING:
    from kvconnector_core.engine.engine import (
        Engine,
        EngineConfig,
        RequestOutput,
        RunMetrics,
        RunResult,
    )
    from kvconnector_core.engine.models import MODEL_PRESETS, get_model
    from kvconnector_core.engine.workloads import (
        WORKLOADS,
        Trace,
        TraceRequest,
        dump_trace_jsonl,
        get_workload,
        load_trace_jsonl,
    )
    from kvconnector_core.worker.model import ModelConfig

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "MODEL_PRESETS",
    "NONE_HASH",
    "WORKLOADS",
    "AllBlocksCleared",
    "AttentionSpec",
    "BlockHash",
    "BlockHashWithGroupId",
    "BlockRemoved",
    "BlockSizeError",
    "BlockStored",
    "CachedRequestData",
    "ChunkedLocalAttentionSpec",
    "ConfigError",
    "ConnectorEntry",
    "ConnectorHookError",
    "ConnectorRegistry",
    "ConnectorSettings",
    "DuplicateConnectorError",
    "Engine",
    "EngineConfig",
    "ExternalBlockHash",
    "FullAttentionSpec",
    "GPUBlockPoolView",
    "InvalidConnectorError",
    "InvariantError",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVConnectorBase",
    "KVConnectorBase_V1",
    "KVConnectorConfig",
    "KVConnectorError",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorSchedulerSide",
    "KVConnectorTransferResults",
    "KVConnectorWorkerSide",
    "KVEventBatch",
    "ModelConfig",
    "NewRequestData",
    "NoFreeBlocksError",
    "PluginDeniedError",
    "PluginFailure",
    "PluginLoadError",
    "PluginRecord",
    "RegistryError",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "RoleSplitConnector",
    "RunMetrics",
    "RunResult",
    "SchedulerOutput",
    "ShutdownError",
    "SlidingWindowSpec",
    "StorePlanner",
    "Trace",
    "TraceRequest",
    "TransferError",
    "UnknownConnectorError",
    "check_metadata_roundtrip",
    "create_connector",
    "decode_event_batch",
    "dump_trace_jsonl",
    "encode_event_batch",
    "get_block_hash",
    "get_connector_class",
    "get_group_id",
    "get_model",
    "get_registry",
    "get_workload",
    "hash_block_tokens",
    "hash_request_tokens",
    "hookimpl",
    "load_connector_config",
    "load_trace_jsonl",
    "lora_name_of",
    "make_block_hash_with_group_id",
    "reset_registry",
    "to_external_hash",
    "yield_req_data",
]

# name -> defining submodule, imported on first use (these modules import torch).
_LAZY = {
    "Engine": "engine.engine",
    "EngineConfig": "engine.engine",
    "RequestOutput": "engine.engine",
    "RunMetrics": "engine.engine",
    "RunResult": "engine.engine",
    "MODEL_PRESETS": "engine.models",
    "get_model": "engine.models",
    "WORKLOADS": "engine.workloads",
    "Trace": "engine.workloads",
    "TraceRequest": "engine.workloads",
    "dump_trace_jsonl": "engine.workloads",
    "get_workload": "engine.workloads",
    "load_trace_jsonl": "engine.workloads",
    "ModelConfig": "worker.model",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
