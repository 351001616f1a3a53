"""CPU offloading connector: keeps evicted prefix blocks in a pinned CPU tier.

:class:`OffloadingConnector` (``connector``; registered as ``OffloadingConnector``, alias
``cpu_offload``) ties the two role objects to the connector API: the scheduler side
(``scheduler``: plans loads and stores over a :class:`CPUOffloadingManager`'s slots) and
the worker side (``worker``: moves the bytes with the transfer engine,
:mod:`connectors.offload.transfer`). ``config`` holds the typed settings, ``records`` what
crosses between the roles. Subpackages: ``manager`` (the manager and its pluggable
:class:`CachePolicy` s, ``"lru"`` and ``"arc"``), ``transfer`` (the block mover) and
``tiers`` (secondary tiers behind the CPU tier). See ``docs/offload.md``.

Names are imported lazily so that ``import connectors.offload`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvconnector_core._lazy import lazy_exports

if TYPE_CHECKING:
    from connectors.offload.connector import OffloadingConnector, OffloadWorkerMetadata
    from connectors.offload.manager import (
        ARCCachePolicy,
        CachePolicy,
        CPUOffloadingManager,
        LoadStoreSpec,
        LRUCachePolicy,
        OffloadingEvent,
        OffloadingManager,
        PrepareStoreOutput,
        available_cache_policies,
        get_cache_policy,
        register_cache_policy,
    )

# name -> defining module. Imported on first use: the worker-side transfer module must
# be importable with torch alone (no msgspec), and the connector pulls in more.
_EXPORTS = {
    "ARCCachePolicy": "manager",
    "CPUOffloadingManager": "manager",
    "CachePolicy": "manager",
    "LRUCachePolicy": "manager",
    "LoadStoreSpec": "manager",
    "OffloadingConnector": "connector",
    "OffloadWorkerMetadata": "connector",
    "OffloadingEvent": "manager",
    "OffloadingManager": "manager",
    "PrepareStoreOutput": "manager",
    "available_cache_policies": "manager",
    "get_cache_policy": "manager",
    "register_cache_policy": "manager",
}

__all__ = [
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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
