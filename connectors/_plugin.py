"""The built-in plugin: registers kvconnector's own connectors.

Declared as entry point ``builtin`` in group ``kvconnector`` of the
``kvconnector`` distribution, so the built-ins come through exactly the hook
third-party plugins use (``KVCONNECTOR_PLUGINS_DENY=builtin`` removes them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvconnector_core.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from kvconnector_core.plugins.registry import ConnectorRegistry

__all__ = ["kvconnector_register_connectors"]


@hookimpl
def kvconnector_register_connectors(registry: ConnectorRegistry) -> None:
    """Register MultiConnector and, when it is shipped, the CPU OffloadingConnector."""
    from connectors.multi.connector import MultiConnector

    registry.add(MultiConnector)
    try:
        from connectors.offload.connector import OffloadingConnector
    except ModuleNotFoundError as exc:
        # Only "the offload connector is not part of this build" is tolerated;
        # a missing dependency inside it is a real error and is reported.
        if exc.name not in ("connectors.offload", "connectors.offload.connector"):
            raise
        return
    registry.add(OffloadingConnector, aliases=("cpu_offload",))
