"""CPU offloading connector: keeps evicted prefix blocks in a pinned CPU tier.

Scheduler side: :class:`CPUOffloadingManager` (slots, ref counts, events) over a
pluggable :class:`CachePolicy` (``"lru"``, ``"arc"``). Worker side:
:mod:`connectors.offload.transfer` moves blocks between the GPU KV cache and the CPU
buffer. :class:`OffloadingConnector` (registered as ``OffloadingConnector``, alias
``cpu_offload``) ties both to the connector API. See ``docs/offload.md``.

Names are imported lazily so that ``import connectors.offload`` stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connectors.offload.connector import OffloadingConnector, OffloadWorkerMetadata
    from connectors.offload.manager import (
        CPUOffloadingManager,
        LoadStoreSpec,
        OffloadingEvent,
        OffloadingManager,
        PrepareStoreOutput,
    )
    from connectors.offload.policies import (
        ARCCachePolicy,
        CachePolicy,
        LRUCachePolicy,
        available_cache_policies,
        get_cache_policy,
        register_cache_policy,
    )

# name -> defining module. Imported on first use: the worker-side transfer module must
# be importable with torch alone (no msgspec), and the connector pulls in more.
_EXPORTS = {
    "ARCCachePolicy": "policies",
    "CPUOffloadingManager": "manager",
    "CachePolicy": "policies",
    "LRUCachePolicy": "policies",
    "LoadStoreSpec": "manager",
    "OffloadingConnector": "connector",
    "OffloadWorkerMetadata": "connector",
    "OffloadingEvent": "manager",
    "OffloadingManager": "manager",
    "PrepareStoreOutput": "manager",
    "available_cache_policies": "policies",
    "get_cache_policy": "policies",
    "register_cache_policy": "policies",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return list(__all__)
