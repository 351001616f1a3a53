"""Registry of the CPU offloading tier's cache policies by name (``cache_policy``).

Built in: ``"lru"`` (:class:`~connectors.offload.manager.lru.LRUCachePolicy`) and
``"arc"`` (:class:`~connectors.offload.manager.arc.ARCCachePolicy`).

Primitives: :func:`register_cache_policy`, :func:`get_cache_policy`,
:func:`available_cache_policies`.
"""

from __future__ import annotations

from connectors.offload.manager.arc import ARCCachePolicy
from connectors.offload.manager.lru import LRUCachePolicy
from connectors.offload.manager.policy import CachePolicy
from kvconnector_core._suggest import did_you_mean
from kvconnector_core.errors import ConfigError

__all__ = [
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
        known = available_cache_policies()
        hint = did_you_mean(str(name), known)
        msg = (f"unknown cache policy {name!r}{hint}; known policies: "
               f"{', '.join(repr(p) for p in known)}")
        raise ConfigError(msg)
    return cls
