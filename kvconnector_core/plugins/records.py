"""Records of the connector registry: registered classes, plugins, plugin failures.

Primitives: :class:`ConnectorEntry`, :class:`PluginRecord`, :class:`PluginFailure`,
:data:`DIRECT`, :func:`plugin_record`.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

from kvconnector_core.connector.base import KVConnectorBase_V1
from kvconnector_core.errors import RegistryError

__all__ = ["DIRECT", "ConnectorEntry", "PluginFailure", "PluginRecord", "plugin_record"]


@dataclass(frozen=True, slots=True)
class ConnectorEntry:
    """One registered connector class.

    Attributes:
        name: the connector's registered name.
        cls: the connector class.
        aliases: other names that resolve to it.
        distribution: installed distribution that provided it (None when added directly).
        version: that distribution's version, if known.
        source: entry-point name of the plugin that added it, or ``"direct"``.
    """

    name: str
    cls: type[KVConnectorBase_V1]
    aliases: tuple[str, ...] = ()
    distribution: str | None = None
    version: str | None = None
    source: str = "direct"

    @property
    def class_path(self) -> str:
        """``module.QualName`` of the class."""
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


@dataclass(frozen=True, slots=True)
class PluginRecord:
    """Where a plugin came from (an entry point, or a direct registration).

    Attributes:
        entry_point: entry-point name (``"direct"`` for classes added by code).
        distribution: distribution declaring the entry point, if known.
        version: that distribution's version, if known.
        value: the entry point's target (``module:attr``), if any.
    """

    entry_point: str
    distribution: str | None = None
    version: str | None = None
    value: str | None = None

    def describe(self) -> str:
        """Human description, e.g. ``entry point 'ttl' (distribution kvconnector-ttl 0.1.0)``."""
        if self.entry_point == "direct":
            return "direct registration"
        dist = self.distribution or "unknown distribution"
        if self.version:
            dist = f"{dist} {self.version}"
        return f"entry point {self.entry_point!r} (distribution {dist})"


DIRECT = PluginRecord("direct")
"""The record of classes added by code rather than by a plugin."""


@dataclass(frozen=True, slots=True)
class PluginFailure:
    """A plugin problem found while loading; the other plugins still loaded.

    Attributes:
        plugin: the plugin at fault.
        error: the error (a :class:`RegistryError` subclass; the original
            exception, if any, is its ``__cause__``).
    """

    plugin: PluginRecord
    error: RegistryError

    @property
    def message(self) -> str:
        """The error message."""
        return str(self.error)


def plugin_record(ep: importlib.metadata.EntryPoint) -> PluginRecord:
    """The record of an entry point (with its distribution and version when its metadata
    is readable)."""
    dist = getattr(ep, "dist", None)
    dist_name = version = None
    if dist is not None:
        try:
            dist_name = dist.name
            version = dist.version
        except Exception:  # noqa: BLE001 - a broken METADATA file must not stop the listing
            dist_name = None
    return PluginRecord(ep.name, dist_name, version, ep.value)
