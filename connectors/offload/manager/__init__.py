"""The CPU offloading tier's manager and its cache policies.

The manager (:mod:`.cpu`) owns slots, ref counts and events; a cache policy owns the
key -> :class:`SlotEntry` map of one tier and its eviction order.

Primitives:
    OffloadKey / SlotEntry / RequestAccess / CachePolicy
                                           the policy interface (:mod:`.policy`)
    LRUCachePolicy                         least recently used (:mod:`.lru`)
    ARCCachePolicy                         adaptive replacement cache (:mod:`.arc`)
    register_cache_policy / get_cache_policy / available_cache_policies
                                           the registry of policy names (:mod:`.registry`)
    LoadStoreSpec / PrepareStoreOutput / OffloadingEvent / OffloadingManager /
    CPUOffloadingManager                   the manager and its records (:mod:`.cpu`)
"""

from __future__ import annotations

from connectors.offload.manager.arc import ARCCachePolicy
from connectors.offload.manager.cpu import (
    CPUOffloadingManager,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from connectors.offload.manager.lru import LRUCachePolicy
from connectors.offload.manager.policy import CachePolicy, OffloadKey, RequestAccess, SlotEntry
from connectors.offload.manager.registry import (
    available_cache_policies,
    get_cache_policy,
    register_cache_policy,
)

__all__ = [
    "ARCCachePolicy",
    "CPUOffloadingManager",
    "CachePolicy",
    "LRUCachePolicy",
    "LoadStoreSpec",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "RequestAccess",
    "SlotEntry",
    "available_cache_policies",
    "get_cache_policy",
    "register_cache_policy",
]
