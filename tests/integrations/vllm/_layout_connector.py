"""A connector that states a preferred KV cache layout (for the adapter suite)."""

from __future__ import annotations

from typing import ClassVar

from ttl_connector import TTLPinConnector


class LayoutPreferringTTL(TTLPinConnector):
    """The TTL connector, asking engines for the BLHNC layout."""

    name: ClassVar[str] = "LayoutPreferringTTL"
    required_kv_cache_layout: ClassVar[str | None] = "BLHNC"
