"""How the connector registry loads its plugins: entry points, the built-in plugin, pluggy.

A mixin of :class:`~kvconnector_core.connector.registry.ConnectorRegistry`, which documents
the behaviour (one failing plugin never takes the others down); the constants are
re-exported by ``registry``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pluggy

from kvconnector_core.connector import hookspecs
from kvconnector_core.connector._plugin_policy import PluginPolicy, run_contained
from kvconnector_core.connector._records import PluginRecord, plugin_record
from kvconnector_core.connector.base import KVConnectorBase_V1
from kvconnector_core.errors import PluginLoadError, RegistryError

__all__ = ["BUILTIN_PLUGIN_MODULE", "BUILTIN_PLUGIN_NAME", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME
"""Entry-point group plugins declare (``[project.entry-points.kvconnector]``)."""
BUILTIN_PLUGIN_NAME = "builtin"
"""Entry-point name of the built-in connectors' plugin."""
BUILTIN_PLUGIN_MODULE = "connectors._plugin"
"""Module of the built-in connectors' plugin."""
_BUILTIN_DISTRIBUTION = "kvconnector"


class _PluginLoading:
    """ConnectorRegistry mixin: loading plugins from entry points."""

    _current: PluginRecord | None
    _policy: PluginPolicy | None
    skipped: list[tuple[PluginRecord, str]]
    plugin_manager: pluggy.PluginManager

    if TYPE_CHECKING:  # defined by ConnectorRegistry
        def add(self, cls: type[KVConnectorBase_V1], *, aliases: Iterable[str] = ()) -> None: ...
        def _record(self, plugin: PluginRecord, exc: RegistryError) -> None: ...

    def load_plugins(
        self,
        entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
        *,
        allow: Iterable[str] | None = None,
        deny: Iterable[str] | None = None,
        builtin_fallback: bool = True,
    ) -> None:
        """Load plugins from entry points and let each register its connectors.

        Each entry point is loaded and called on its own; a failure is
        recorded in :attr:`errors` and loading goes on. The built-in plugin is
        loaded first. If no entry point targets it (e.g. running from a source
        tree that was never installed), it is loaded directly so that the
        built-in connectors always exist unless denied.

        Args:
            entry_points: the entry points to load; default: those installed
                in group ``kvconnector``.
            allow: third-party plugins allowed to load (entry-point or
                distribution names); default: ``$KVCONNECTOR_PLUGINS_ALLOW``,
                or all when unset.
            deny: plugins that must not load (``builtin`` included); default:
                ``$KVCONNECTOR_PLUGINS_DENY``. Both lists also apply to the
                ``module_path`` of configs resolved through this registry.
            builtin_fallback: load ``connectors._plugin`` directly when no
                entry point targets it.
        """
        if entry_points is None:
            entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        self._policy = policy = PluginPolicy.resolve(allow, deny)
        seen: set[tuple[str, str]] = set()
        eps: list[importlib.metadata.EntryPoint] = []
        for ep in entry_points:
            # An editable install can expose the same entry point twice.
            if (ep.name, ep.value) not in seen:
                seen.add((ep.name, ep.value))
                eps.append(ep)
        builtin_seen = any(ep.value.split(":")[0] == BUILTIN_PLUGIN_MODULE for ep in eps)
        eps.sort(key=lambda ep: (ep.value.split(":")[0] != BUILTIN_PLUGIN_MODULE, ep.name))
        if not builtin_seen and builtin_fallback:
            record = PluginRecord(BUILTIN_PLUGIN_NAME, _BUILTIN_DISTRIBUTION, None, BUILTIN_PLUGIN_MODULE)
            if not self._excluded(record, True, policy):
                self._load_one(record, lambda: importlib.import_module(BUILTIN_PLUGIN_MODULE))
        for ep in eps:
            record = plugin_record(ep)
            is_builtin = ep.value.split(":")[0] == BUILTIN_PLUGIN_MODULE
            if not self._excluded(record, is_builtin, policy):
                self._load_one(record, ep.load)

    def _excluded(self, record: PluginRecord, is_builtin: bool, policy: PluginPolicy) -> bool:
        names = [record.entry_point, *([record.distribution] if record.distribution else [])]
        reason = policy.exclusion(names, is_builtin=is_builtin)
        if reason is not None:
            self.skipped.append((record, reason))
        return reason is not None

    def _load_one(self, record: PluginRecord, load: Any) -> None:
        """Import one plugin, register it with pluggy, and call its hook."""
        where = record.describe()
        try:
            obj = run_contained(load, lambda exc: f"{where} failed to load {record.value!r}: "
                                                  f"{type(exc).__name__}: {exc}")
        except RegistryError as err:
            self._record(record, err)
            return
        if isinstance(obj, type) and issubclass(obj, KVConnectorBase_V1):
            # Convenience: an entry point may name a connector class directly.
            self._call_hook(record, lambda: self.add(obj))
            return
        pm = self.plugin_manager
        try:
            if not pm.is_registered(obj):  # two entry points may name one module
                plugin_name = record.entry_point
                if pm.get_plugin(plugin_name) is not None:
                    plugin_name = f"{record.entry_point}@{record.distribution}:{record.value}"
                pm.register(obj, name=plugin_name)
            pm.check_pending()
        except (pluggy.PluginValidationError, ValueError) as exc:
            if pm.is_registered(obj):
                pm.unregister(obj)
            load_err = PluginLoadError(f"{where} has invalid kvconnector hooks: {exc}")
            load_err.__cause__ = exc
            self._record(record, load_err)
            return
        impls = [i for i in pm.hook.kvconnector_register_connectors.get_hookimpls() if i.plugin is obj]
        if not impls:
            msg = f"{where} defines no @hookimpl kvconnector_register_connectors(registry)"
            self._record(record, PluginLoadError(msg))
            return
        for impl in impls:
            self._call_hook(record, lambda impl=impl: impl.function(**({"registry": self} if impl.argnames else {})))

    def _call_hook(self, record: PluginRecord, call: Any) -> None:
        self._current = record
        try:
            # A plugin's hook must not take the others down, whatever it raises.
            run_contained(call, lambda exc: f"{record.describe()} raised in kvconnector_register_connectors: "
                                            f"{type(exc).__name__}: {exc}")
        except RegistryError as exc:
            self._record(record, exc)
        finally:
            self._current = None
