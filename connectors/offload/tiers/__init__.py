"""Secondary KV tiers behind the CPU tier: local disk and Redis.

A tier stores block values (bytes copied out of the CPU tier) under
:class:`TierKey` (block hash, KV cache group, and the worker's :class:`Shard` under tensor /
pipeline parallelism) and never touches GPU memory. Its methods
never block the engine: lookups may answer None ("ask again"), stores are dropped and
counted when the tier falls behind, loads are polled. See ``docs/tiers.md``.

:func:`make_tier` builds one from a settings dict (``{"type": "disk" | "redis", ...}``).
Names are imported lazily so that ``import connectors.offload.tiers`` needs neither redis-py nor
a file system.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import TYPE_CHECKING, Any

from kvconnector_core._lazy import lazy_exports

if TYPE_CHECKING:
    from connectors.offload.tiers.base import SecondaryTier
    from connectors.offload.tiers.disk import DiskTier, DiskTierConfig
    from connectors.offload.tiers.records import Shard, TierEvent, TierKey, TierLoad
    from connectors.offload.tiers.redis_tier import RedisTier, RedisTierConfig

_EXPORTS = {
    "DiskTier": "disk",
    "DiskTierConfig": "disk",
    "RedisTier": "redis_tier",
    "RedisTierConfig": "redis_tier",
    "SecondaryTier": "base",
    "Shard": "records",
    "TierEvent": "records",
    "TierKey": "records",
    "TierLoad": "records",
}

TIER_TYPES = {"disk": ("disk", "DiskTier"), "redis": ("redis_tier", "RedisTier")}
"""Tier ``type`` -> (module, class) accepted by :func:`make_tier`."""

__all__ = [
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


def make_tier(spec: dict[str, Any], *, enable_events: bool = True, shard: Shard | None = None
              ) -> SecondaryTier:
    """Create a tier from ``{"type": "disk" | "redis", <its config fields>}``; ``shard``:
    the worker shard whose keys it writes (see :class:`SecondaryTier`).

    Raises:
        ConfigError: an unknown type, or a bad / unknown field of its config.
    """
    from kvconnector_core.errors import ConfigError

    spec = dict(spec)
    kind = spec.pop("type", None)
    if kind not in TIER_TYPES:
        msg = f"tier type {kind!r} is not known; valid types: {', '.join(TIER_TYPES)}"
        raise ConfigError(msg)
    module, cls_name = TIER_TYPES[kind]
    cls: Callable[..., SecondaryTier] = getattr(import_module(f"{__name__}.{module}"), cls_name)
    return cls(spec, enable_events=enable_events, shard=shard)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
