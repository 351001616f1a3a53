"""Cache policies of the CPU offloading tier: which offloaded blocks to evict.

A policy owns the key -> :class:`SlotEntry` map of one tier and its eviction order;
the manager (:mod:`connectors.offload.manager`) owns slots, ref counts and events.

Primitives:
    SlotEntry            a live entry: the slot holding the block and its ref count
    CachePolicy          ABC: get / insert / remove / touch / evict(n, protected) / clear
    LRUCachePolicy       least recently used; tails of a touched prefix are evicted first
    ARCCachePolicy       adaptive replacement cache (T1/T2 live lists, B1/B2 ghost lists)
    register_cache_policy(name, cls) / get_cache_policy(name) / available_cache_policies()

Ref counts follow the manager's convention: ``-1`` = being written (not readable, not
evictable), ``0`` = ready and evictable, ``> 0`` = pinned by that many loads.

``evict`` is atomic: it either returns exactly ``n`` victims (already removed from the
policy) or ``None`` having changed nothing, so a refused store leaves no trace.

The interface lives in ``_policy_base``, the two policies in ``_lru`` and ``_arc``; this
module re-exports them and holds the registry of policy names.
"""

from __future__ import annotations

from connectors.offload._arc import ARCCachePolicy
from connectors.offload._lru import LRUCachePolicy
from connectors.offload._policy_base import CachePolicy, OffloadKey, SlotEntry
from kvconnector_core.errors import ConfigError

__all__ = [
    "ARCCachePolicy",
    "CachePolicy",
    "LRUCachePolicy",
    "OffloadKey",
    "SlotEntry",
    "available_cache_policies",
    "get_cache_policy",
    "register_cache_policy",
]

_POLICIES: dict[str, type[CachePolicy]] = {
    "lru": LRUCachePolicy,
    "arc": ARCCachePolicy,
}


def register_cache_policy(name: str, cls: type[CachePolicy]) -> None:
    """Make a cache policy available under ``name`` (case-insensitive).

    Args:
        name: the value users give as ``cache_policy``.
        cls: a :class:`CachePolicy` subclass, constructed as ``cls(capacity)``.

    Raises:
        ConfigError: ``cls`` is not a CachePolicy subclass, or ``name`` is already
            taken by a different class.
    """
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        msg = f"cache policy {name!r}: {cls!r} is not a subclass of CachePolicy"
        raise ConfigError(msg)
    key = name.lower()
    existing = _POLICIES.get(key)
    if existing is not None and existing is not cls:
        msg = (
            f"cache policy {name!r} is already registered to "
            f"{existing.__module__}.{existing.__qualname__}; cannot register "
            f"{cls.__module__}.{cls.__qualname__}"
        )
        raise ConfigError(msg)
    _POLICIES[key] = cls


def available_cache_policies() -> list[str]:
    """Return the registered policy names, sorted."""
    return sorted(_POLICIES)


def get_cache_policy(name: str) -> type[CachePolicy]:
    """Return the policy class registered under ``name`` (case-insensitive).

    Raises:
        ConfigError: no policy of that name; the message lists the known ones.
    """
    cls = _POLICIES.get(str(name).lower())
    if cls is None:
        known = ", ".join(repr(p) for p in available_cache_policies())
        msg = f"unknown cache policy {name!r}; known policies: {known}"
        raise ConfigError(msg)
    return cls
