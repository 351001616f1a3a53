"""The curated public API: the exported sets are pinned, every name resolves and is
documented, and importing the package stays cheap.

A change to an exported set is a change to the API: update the literal list here in the
same commit, on purpose.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

import kvconnector_core

ROOT = Path(__file__).resolve().parents[2]

KVCONNECTOR_CORE = [
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

CONNECTORS = ["LoaderSelectionPolicy", "LongestHitPolicy", "MultiConnector", "OffloadingConnector"]

CONNECTORS_OFFLOAD = [
    "ARCCachePolicy",
    "CPUOffloadingManager",
    "CachePolicy",
    "LRUCachePolicy",
    "LoadStoreSpec",
    "OffloadWorkerMetadata",
    "OffloadingConnector",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "available_cache_policies",
    "get_cache_policy",
    "register_cache_policy",
]

CONNECTORS_TIERS = [
    "TIER_TYPES",
    "DiskTier",
    "DiskTierConfig",
    "RedisTier",
    "RedisTierConfig",
    "SecondaryTier",
    "Shard",
    "TierEvent",
    "TierKey",
    "TierLoad",
    "make_tier",
]

PACKAGES = {
    "kvconnector_core": KVCONNECTOR_CORE,
    "connectors": CONNECTORS,
    "connectors.offload": CONNECTORS_OFFLOAD,
    "connectors.offload.tiers": CONNECTORS_TIERS,
}


@cache
def _attribute_docstrings() -> frozenset[str]:
    """Names assigned at module level somewhere in the library with an attribute docstring
    after them or a ``#:`` doc comment before them (both as Sphinx reads them)."""
    documented = set()
    for path in [*(ROOT / "kvconnector_core").rglob("*.py"), *(ROOT / "connectors").rglob("*.py")]:
        source = path.read_text()
        lines = source.splitlines()
        body = ast.parse(source).body
        for stmt, nxt in zip(body, body[1:], strict=False):
            if isinstance(stmt, ast.Assign):
                targets = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                targets = [stmt.target.id]
            else:
                continue
            has_docstring = (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                             and isinstance(nxt.value.value, str))
            has_doc_comment = stmt.lineno >= 2 and lines[stmt.lineno - 2].lstrip().startswith("#:")
            if has_docstring or has_doc_comment:
                documented.update(targets)
    return frozenset(documented)


@pytest.mark.parametrize("package", list(PACKAGES), ids=list(PACKAGES))
def test_exported_set_is_pinned(package):
    """__all__ is exactly the pinned list: no name joins or leaves the API by accident."""
    module = importlib.import_module(package)
    assert module.__all__ == PACKAGES[package]
    assert len(set(module.__all__)) == len(module.__all__)
    assert sorted(dir(module)) == sorted(module.__all__)


@pytest.mark.parametrize("package", list(PACKAGES), ids=list(PACKAGES))
def test_every_exported_name_resolves_and_is_documented(package):
    """Classes and functions carry a docstring; constants and type aliases (NewTypes,
    unions) an attribute docstring where they are defined."""
    module = importlib.import_module(package)
    undocumented = []
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            doc = obj.__doc__ or ""
            # A class without its own docstring inherits none from object; NamedTuple and
            # Struct subclasses get generated ones, which do not count.
            if not doc.strip() or doc.startswith(f"{name}("):
                undocumented.append(name)
        elif name not in _attribute_docstrings():
            # An instance's __doc__ is its type's, so only the attribute docstring counts.
            undocumented.append(name)
    assert undocumented == []


PLUGINS = [
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


def test_plugin_machinery_is_exported_by_plugins_connector_and_the_package():
    """kvconnector_core.plugins defines the registry's public names; the connector API
    and the package export the same objects (a plugin imports hookimpl from either)."""
    import kvconnector_core.connector as connector
    import kvconnector_core.plugins as plugins

    assert plugins.__all__ == PLUGINS
    for name in PLUGINS:
        assert getattr(connector, name) is getattr(plugins, name), name
        assert name in connector.__all__ and name in KVCONNECTOR_CORE, name
        assert getattr(kvconnector_core, name) is getattr(plugins, name), name


def test_block_hashes_and_offload_keys_are_newtypes_of_bytes():
    """NewTypes: a type checker tells them apart, and at run time they are plain bytes."""
    from connectors.offload.manager import OffloadKey

    for new_type in (kvconnector_core.BlockHash, kvconnector_core.BlockHashWithGroupId, OffloadKey):
        assert new_type.__supertype__ is bytes
    assert type(kvconnector_core.hash_block_tokens(None, [1, 2, 3])) is bytes
    assert (
        type(kvconnector_core.make_block_hash_with_group_id(kvconnector_core.NONE_HASH, 1))
        is bytes
    )


def test_internal_modules_keep_their_import_paths():
    """The engine's internals left the package namespace but not their modules."""
    from kvconnector_core.kv_cache.block_pool import BlockPool
    from kvconnector_core.kv_cache.coordinator import get_kv_cache_coordinator
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheManager
    from kvconnector_core.scheduler import Scheduler

    assert all(inspect.isclass(c) for c in (BlockPool, KVCacheManager, Scheduler))
    assert callable(get_kv_cache_coordinator)
    assert not hasattr(kvconnector_core, "BlockPool")


def test_import_does_not_load_torch_or_plugins():
    """Importing the package imports neither torch nor any connector plugin (no work at import
    time)."""
    code = (
        "import sys, kvconnector_core; "
        "print('torch' in sys.modules, any(m.startswith('connectors') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
