"""kvconnector: a KV-cache connector plugin framework for LLM serving.

The public API lives here; everything else is an implementation detail. Submodules
that need torch (``kvconnector_core.worker``, ``kvconnector_core.engine``) are
not imported by this package, so importing it is cheap.
"""

from kvconnector_core.errors import BlockSizeError
from kvconnector_core.errors import ConfigError
from kvconnector_core.errors import ConnectorHookError
from kvconnector_core.errors import DuplicateConnectorError
from kvconnector_core.errors import InvalidConnectorError
from kvconnector_core.errors import InvariantError
from kvconnector_core.errors import KVConnectorError
from kvconnector_core.errors import NoFreeBlocksError
from kvconnector_core.errors import PluginDeniedError
from kvconnector_core.errors import PluginLoadError
from kvconnector_core.errors import RegistryError
from kvconnector_core.errors import ShutdownError
from kvconnector_core.errors import TransferError
from kvconnector_core.errors import UnknownConnectorError
from kvconnector_core.kv_cache.block_pool import BlockHashToBlockMap
from kvconnector_core.kv_cache.block_pool import BlockPool
from kvconnector_core.kv_cache.block_pool import FreeKVCacheBlockQueue
from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView
from kvconnector_core.kv_cache.block_pool import KVCacheBlock
from kvconnector_core.kv_cache.coordinator import HybridKVCacheCoordinator
from kvconnector_core.kv_cache.coordinator import KVCacheCoordinator
from kvconnector_core.kv_cache.coordinator import KVCacheCoordinatorNoPrefixCache
from kvconnector_core.kv_cache.coordinator import UnitaryKVCacheCoordinator
from kvconnector_core.kv_cache.coordinator import get_kv_cache_coordinator
from kvconnector_core.kv_cache.hashing import NONE_HASH
from kvconnector_core.kv_cache.hashing import BlockHash
from kvconnector_core.kv_cache.hashing import hash_block_tokens
from kvconnector_core.kv_cache.hashing import hash_request_tokens
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
from kvconnector_core.kv_cache.kv_cache_manager import KVCacheManager
from kvconnector_core.kv_cache.kv_cache_spec import ChunkedLocalAttentionSpec
from kvconnector_core.kv_cache.kv_cache_spec import FullAttentionSpec
from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
from kvconnector_core.kv_cache.kv_cache_spec import KVCacheGroupSpec
from kvconnector_core.kv_cache.kv_cache_spec import KVCacheSpec
from kvconnector_core.kv_cache.kv_cache_spec import SlidingWindowSpec
from kvconnector_core.kv_cache.kv_cache_spec import get_kv_cache_config
from kvconnector_core.kv_cache.single_type_manager import ChunkedLocalAttentionManager
from kvconnector_core.kv_cache.single_type_manager import FullAttentionManager
from kvconnector_core.kv_cache.single_type_manager import SingleTypeKVCacheManager
from kvconnector_core.kv_cache.single_type_manager import SlidingWindowManager
from kvconnector_core.kv_cache.single_type_manager import get_manager_for_kv_cache_spec
from kvconnector_core.kv_events import AllBlocksCleared
from kvconnector_core.kv_events import BlockRemoved
from kvconnector_core.kv_events import BlockStored
from kvconnector_core.kv_events import KVCacheEvent
from kvconnector_core.kv_events import KVEventBatch
from kvconnector_core.kv_events import decode_event_batch
from kvconnector_core.kv_events import encode_event_batch
from kvconnector_core.kv_cache.hashing import make_block_hash_with_group_id
from kvconnector_core.kv_cache.hashing import get_block_hash
from kvconnector_core.kv_cache.hashing import get_group_id
from kvconnector_core.kv_cache.hashing import BlockHashWithGroupId
from kvconnector_core.kv_events import to_external_hash
from kvconnector_core.kv_events import ExternalBlockHash
from kvconnector_core.kv_events import MEDIUM_GPU
from kvconnector_core.kv_events import MEDIUM_CPU
from kvconnector_core.kv_events import MEDIUM_STORAGE
from kvconnector_core.kv_events import EventBatch
from kvconnector_core.kv_cache.kv_cache_manager import PrefixCacheStats
from kvconnector_core.request import Request
from kvconnector_core.request import RequestStatus
from kvconnector_core.scheduler import CachedRequestData
from kvconnector_core.scheduler import ModelRunnerOutput
from kvconnector_core.scheduler import NewRequestData
from kvconnector_core.scheduler import Scheduler
from kvconnector_core.scheduler import SchedulerOutput
from kvconnector_core.scheduler import SchedulerStats
from kvconnector_core.scheduler import yield_req_data

from kvconnector_core.connector import KVConnectorBase_V1
from kvconnector_core.connector import KVConnectorBase
from kvconnector_core.connector import KVConnectorRole
from kvconnector_core.connector import KVConnectorMetadata
from kvconnector_core.connector import KVConnectorOutput
from kvconnector_core.connector import KVConnectorTransferResults
from kvconnector_core.connector import KVConnectorConfig
from kvconnector_core.connector import load_connector_config
from kvconnector_core.connector import ConnectorRegistry
from kvconnector_core.connector import ConnectorEntry
from kvconnector_core.connector import PluginFailure
from kvconnector_core.connector import PluginRecord
from kvconnector_core.connector import create_connector
from kvconnector_core.connector import get_connector_class
from kvconnector_core.connector import get_registry
from kvconnector_core.connector import reset_registry
from kvconnector_core.connector import hookimpl
from kvconnector_core.connector import check_metadata_roundtrip


# Names whose modules import torch load on first use, so `import kvconnector_core`
# (and `kvconnector list`) stays cheap.
_LAZY = {
    "Engine": "kvconnector_core.engine.engine",
    "EngineConfig": "kvconnector_core.engine.engine",
    "RunResult": "kvconnector_core.engine.engine",
    "RunMetrics": "kvconnector_core.engine.engine",
    "RequestOutput": "kvconnector_core.engine.engine",
    "Trace": "kvconnector_core.engine.workloads",
    "TraceRequest": "kvconnector_core.engine.workloads",
    "WORKLOADS": "kvconnector_core.engine.workloads",
    "get_workload": "kvconnector_core.engine.workloads",
    "load_trace_jsonl": "kvconnector_core.engine.workloads",
    "dump_trace_jsonl": "kvconnector_core.engine.workloads",
    "ModelConfig": "kvconnector_core.worker.model",
    "MODEL_PRESETS": "kvconnector_core.engine.models",
    "get_model": "kvconnector_core.engine.models",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvconnector_core' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)


__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockHashToBlockMap",
    "BlockHashWithGroupId",
    "BlockPool",
    "BlockRemoved",
    "BlockSizeError",
    "BlockStored",
    "CachedRequestData",
    "check_metadata_roundtrip",
    "ChunkedLocalAttentionManager",
    "ChunkedLocalAttentionSpec",
    "ConfigError",
    "ConnectorEntry",
    "ConnectorHookError",
    "ConnectorRegistry",
    "create_connector",
    "decode_event_batch",
    "dump_trace_jsonl",
    "DuplicateConnectorError",
    "encode_event_batch",
    "Engine",
    "EngineConfig",
    "EventBatch",
    "ExternalBlockHash",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "FullAttentionSpec",
    "get_block_hash",
    "get_connector_class",
    "get_group_id",
    "get_kv_cache_config",
    "get_kv_cache_coordinator",
    "get_manager_for_kv_cache_spec",
    "get_model",
    "get_registry",
    "get_workload",
    "GPUBlockPoolView",
    "hash_block_tokens",
    "hash_request_tokens",
    "hookimpl",
    "HybridKVCacheCoordinator",
    "InvalidConnectorError",
    "InvariantError",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "KVCacheSpec",
    "KVConnectorBase",
    "KVConnectorBase_V1",
    "KVConnectorConfig",
    "KVConnectorError",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorTransferResults",
    "KVEventBatch",
    "load_connector_config",
    "load_trace_jsonl",
    "make_block_hash_with_group_id",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "MODEL_PRESETS",
    "ModelConfig",
    "ModelRunnerOutput",
    "NewRequestData",
    "NoFreeBlocksError",
    "NONE_HASH",
    "PluginDeniedError",
    "PluginFailure",
    "PluginLoadError",
    "PluginRecord",
    "PrefixCacheStats",
    "RegistryError",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "reset_registry",
    "RunMetrics",
    "RunResult",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "ShutdownError",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "SlidingWindowSpec",
    "to_external_hash",
    "Trace",
    "TraceRequest",
    "TransferError",
    "UnitaryKVCacheCoordinator",
    "UnknownConnectorError",
    "WORKLOADS",
    "yield_req_data",
]
