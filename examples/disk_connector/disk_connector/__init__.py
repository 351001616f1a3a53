"""kvconnector-disk: a local-disk KV tier, one file per block."""

from __future__ import annotations

from disk_connector.connector import DiskConnector, DiskMetadata, DiskSettings

__all__ = ["DiskConnector", "DiskMetadata", "DiskSettings"]
__version__ = "0.1.0"
