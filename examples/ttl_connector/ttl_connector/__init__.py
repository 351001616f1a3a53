"""kvconnector-ttl: a ref-count/TTL connector that pins hot prefix blocks in the GPU pool."""

from __future__ import annotations

from ttl_connector.connector import TTLMetadata, TTLPinConnector

__all__ = ["TTLMetadata", "TTLPinConnector"]
__version__ = "0.1.0"
