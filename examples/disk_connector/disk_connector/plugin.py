"""The plugin module named by this distribution's ``kvconnector`` entry point."""

from __future__ import annotations

from typing import Any

from kvconnector_core.connector import hookimpl

__all__ = ["kvconnector_register_connectors"]


@hookimpl
def kvconnector_register_connectors(registry: Any) -> None:
    """Register DiskConnector (alias ``disk``)."""
    from disk_connector.connector import DiskConnector  # imported only when plugins load

    registry.add(DiskConnector)
