"""The plugin module named by this distribution's ``kvconnector`` entry point."""

from __future__ import annotations

from typing import Any

from kvconnector_core.connector import hookimpl

__all__ = ["kvconnector_register_connectors"]


@hookimpl
def kvconnector_register_connectors(registry: Any) -> None:
    """Register TTLPinConnector (name from its class attribute, alias ``ttl``)."""
    from ttl_connector.connector import TTLPinConnector  # imported only when plugins load

    registry.add(TTLPinConnector)
