"""The connector registry: names -> connector classes, filled by plugins.

Plugins are found through entry points in group ``kvconnector`` and called
through the pluggy hook ``kvconnector_register_connectors(registry)``; the
built-in connectors come in the same way (entry point ``builtin`` of the
``kvconnector`` distribution). Nothing is loaded at import time: the default
registry (:func:`get_registry`) loads its plugins the first time it is needed,
exactly once.

Loading is loud but tolerant: each entry point is loaded on its own, so one
that fails to import (whatever it raises, ``sys.exit()`` included), registers a
class that is not a connector, or claims a name another class already holds is
recorded in :attr:`ConnectorRegistry.errors` (naming the entry point and its
distribution) while the other plugins still load. A name or alias claimed by two
different classes is unusable until one of them is removed:
:meth:`ConnectorRegistry.get` raises :class:`DuplicateConnectorError` naming both
classes and both plugins, rather than silently picking one (and
:meth:`ConnectorRegistry.conflict` tells a caller with a default name that it is
claimed twice rather than absent).

Environment controls (comma-separated entry-point or distribution names):

- ``KVCONNECTOR_PLUGINS_ALLOW``: only these third-party plugins load. The
  built-in plugin (entry point ``builtin``, distribution ``kvconnector``) is not
  subject to the allow-list.
- ``KVCONNECTOR_PLUGINS_DENY``: these plugins do not load; ``builtin`` may be
  denied too (then only third-party connectors exist).

A config's ``module_path`` is checked against the same lists (matching the module,
any package above it, or its distribution) before anything is imported.

The registry records what it registered and what failed with the records of
:mod:`kvconnector_core.plugins.records`, and asks :mod:`kvconnector_core.plugins.policy`
which plugins may load.

Primitives: :class:`ConnectorRegistry`, :func:`get_registry`, :func:`reset_registry`,
:func:`get_connector_class`, :func:`create_connector`, :data:`ENTRY_POINT_GROUP`,
:data:`BUILTIN_PLUGIN_NAME`, :data:`BUILTIN_PLUGIN_MODULE`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import pluggy

from kvconnector_core._suggest import did_you_mean
from kvconnector_core.connector.base import KVConnectorBase_V1, KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.errors import (
    DuplicateConnectorError,
    InvalidConnectorError,
    PluginLoadError,
    RegistryError,
    UnknownConnectorError,
)
from kvconnector_core.plugins import hookspecs
from kvconnector_core.plugins.policy import (
    ENV_PLUGINS_DENY,
    PluginPolicy,
    run_contained,
)
from kvconnector_core.plugins.records import (
    DIRECT,
    ConnectorEntry,
    PluginFailure,
    PluginRecord,
    plugin_record,
)

if TYPE_CHECKING:
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig

__all__ = [
    "BUILTIN_PLUGIN_MODULE",
    "BUILTIN_PLUGIN_NAME",
    "ENTRY_POINT_GROUP",
    "ConnectorRegistry",
    "create_connector",
    "get_connector_class",
    "get_registry",
    "reset_registry",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = hookspecs.PROJECT_NAME
"""Entry-point group plugins declare (``[project.entry-points.kvconnector]``)."""
BUILTIN_PLUGIN_NAME = "builtin"
"""Entry-point name of the built-in connectors' plugin."""
BUILTIN_PLUGIN_MODULE = "connectors._plugin"
"""Module of the built-in connectors' plugin."""
_BUILTIN_DISTRIBUTION = "kvconnector"


class ConnectorRegistry:
    """Connector classes by name, with the plugin each came from.

    Build one directly in tests (``ConnectorRegistry()`` then :meth:`add` or
    :meth:`load_plugins`); the engine uses the lazily-built default from
    :func:`get_registry`.
    """

    def __init__(self) -> None:
        """Create an empty registry (no plugin is loaded until :meth:`load_plugins`)."""
        self._entries: dict[str, ConnectorEntry] = {}  # canonical name -> entry
        self._lookup: dict[str, str] = {}  # name or alias -> canonical name
        self._conflicts: dict[str, DuplicateConnectorError] = {}
        self._current: PluginRecord | None = None  # plugin whose hook is running
        # the last load_plugins' lists (None: the environment's)
        self._policy: PluginPolicy | None = None
        self.errors: list[PluginFailure] = []
        """Plugin problems recorded while loading (see :class:`PluginFailure`)."""
        self.skipped: list[tuple[PluginRecord, str]] = []
        """Plugins not loaded on purpose: ``(plugin, reason)`` (allow/deny lists)."""
        self.plugin_manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        """The pluggy manager holding every loaded plugin."""
        self.plugin_manager.add_hookspecs(hookspecs)

    # ------------------------------------------------------------- registering

    def add(self, cls: type[KVConnectorBase_V1], *, aliases: Iterable[str] = ()) -> None:
        """Register a connector class under ``cls.name`` (and its aliases).

        Registering the same class again is a no-op (new aliases are added).

        Args:
            cls: a concrete :class:`KVConnectorBase_V1` subclass with a
                non-empty ``name``.
            aliases: extra names, added to the class attribute ``aliases``.

        Raises:
            InvalidConnectorError: ``cls`` is not a concrete connector class
                or has no name.
            DuplicateConnectorError: another class already holds the name or
                an alias; the message names both classes and their plugins.
            When called from a plugin's hook during :meth:`load_plugins`, the
            error is recorded in :attr:`errors` instead and the plugin's other
            classes still register.
        """
        plugin = self._current or DIRECT
        try:
            self._add(cls, tuple(aliases), plugin)
        except RegistryError as exc:
            if self._current is None:
                raise
            self._record(plugin, exc)

    def _add(self, cls: Any, extra_aliases: tuple[str, ...], plugin: PluginRecord) -> None:
        name = self._validate(cls, plugin)
        declared = (*getattr(cls, "aliases", ()), *extra_aliases)
        names = [name, *dict.fromkeys(a for a in declared if a != name)]
        for alias in names:
            if not isinstance(alias, str) or not alias:
                msg = (f"{cls.__module__}.{cls.__qualname__} has an invalid alias {alias!r} "
                       f"(from {plugin.describe()}): aliases must be non-empty strings")
                raise InvalidConnectorError(msg)
        for alias in names:
            holder = self._lookup.get(alias)
            if holder is not None and self._entries[holder].cls is not cls:
                self._conflict(alias, self._entries[holder], cls, plugin)
        # Register only the names that did not clash (a clash raised above).
        existing = self._entries.get(name)
        if existing is not None and existing.cls is cls:
            merged = tuple(dict.fromkeys((*existing.aliases, *names[1:])))
            self._entries[name] = ConnectorEntry(
                name, cls, merged, existing.distribution, existing.version, existing.source
            )
        else:
            self._entries[name] = ConnectorEntry(
                name, cls, tuple(names[1:]), plugin.distribution, plugin.version, plugin.entry_point
            )
        for alias in names:
            self._lookup[alias] = name

    def _validate(self, cls: Any, plugin: PluginRecord) -> str:
        where = plugin.describe()
        if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
            msg = (
                f"{where} registered {cls!r}, which is not a connector class: register a "
                f"subclass of kvconnector_core.connector.KVConnectorBase_V1"
            )
            raise InvalidConnectorError(msg)
        qual = f"{cls.__module__}.{cls.__qualname__}"
        if inspect.isabstract(cls):
            missing = sorted(getattr(cls, "__abstractmethods__", ()))
            msg = (f"{where} registered {qual}, which does not implement the abstract hooks "
                   f"{missing}")
            raise InvalidConnectorError(msg)
        name = getattr(cls, "name", "")
        if not isinstance(name, str) or not name:
            msg = (f"{where} registered {qual} without a name: set the class attribute "
                   f"`name = \"...\"`")
            raise InvalidConnectorError(msg)
        return name

    def _conflict(self, name: str, holder: ConnectorEntry, cls: type, plugin: PluginRecord) -> None:
        holder_plugin = PluginRecord(holder.source, holder.distribution, holder.version)
        msg = (
            f"connector name {name!r} is claimed by two classes: "
            f"{holder.class_path} from {holder_plugin.describe()} and "
            f"{cls.__module__}.{cls.__qualname__} from {plugin.describe()}; "
            f"uninstall one or deny it with {ENV_PLUGINS_DENY}"
        )
        exc = DuplicateConnectorError(msg)
        self._conflicts[name] = exc
        raise exc

    def _record(self, plugin: PluginRecord, exc: RegistryError) -> None:
        logger.warning("kvconnector plugin problem: %s", exc)
        self.errors.append(PluginFailure(plugin, exc))

    # ---------------------------------------------------------- loading plugins

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
            record = PluginRecord(BUILTIN_PLUGIN_NAME, _BUILTIN_DISTRIBUTION, None,
                                  BUILTIN_PLUGIN_MODULE)
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
        impls = [i for i in pm.hook.kvconnector_register_connectors.get_hookimpls()
                 if i.plugin is obj]
        if not impls:
            msg = f"{where} defines no @hookimpl kvconnector_register_connectors(registry)"
            self._record(record, PluginLoadError(msg))
            return
        for impl in impls:
            kwargs = {"registry": self} if impl.argnames else {}
            self._call_hook(record, functools.partial(impl.function, **kwargs))

    def _call_hook(self, record: PluginRecord, call: Any) -> None:
        self._current = record
        try:
            # A plugin's hook must not take the others down, whatever it raises.
            run_contained(call, lambda exc: (f"{record.describe()} raised in "
                                             f"kvconnector_register_connectors: "
                                             f"{type(exc).__name__}: {exc}"))
        except RegistryError as exc:
            self._record(record, exc)
        finally:
            self._current = None

    # ---------------------------------------------------------------- queries

    def get(self, name: str) -> type[KVConnectorBase_V1]:
        """Return the connector class registered under ``name`` (or an alias).

        Raises:
            DuplicateConnectorError: two classes claim ``name``.
            UnknownConnectorError: nothing is registered under ``name``; the
                message lists the available names and any plugin that failed.
        """
        if name in self._conflicts:
            raise self._conflicts[name]
        canonical = self._lookup.get(name)
        if canonical is None:
            # One message for every place a name is resolved (CLI, configs, MultiConnector
            # children), with aliases, since configs accept them.
            available = ", ".join(
                e.name + (f" (aliases: {', '.join(e.aliases)})" if e.aliases else "")
                for e in self.entries()) or "none"
            msg = (f"unknown connector {name!r}{did_you_mean(name, self._lookup)}; "
                   f"available connectors: {available}")
            if self.errors:
                failed = "; ".join(f.plugin.describe() for f in self.errors)
                msg += f" (plugins with errors, see `kvconnector list`: {failed})"
            raise UnknownConnectorError(msg)
        return self._entries[canonical].cls

    def conflict(self, name: str) -> DuplicateConnectorError | None:
        """The error naming both claimants if two classes claim ``name``, else None.

        ``name in registry`` is False for such a name; a caller falling back to a
        default name uses this to report the clash instead of treating it as absent.
        """
        return self._conflicts.get(name)

    def _module_path_policy(self) -> PluginPolicy:
        """The allow/deny lists a connector ``module_path`` is checked against.

        Those of the last :meth:`load_plugins`, or the environment's when none ran.
        """
        return self._policy if self._policy is not None else PluginPolicy.resolve()

    def get_entry(self, name: str) -> ConnectorEntry:
        """Return the :class:`ConnectorEntry` for ``name`` or an alias (errors as :meth:`get`)."""
        self.get(name)
        return self._entries[self._lookup[name]]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._lookup and name not in self._conflicts

    def names(self) -> list[str]:
        """Return the registered canonical names, sorted."""
        return sorted(self._entries)

    def entries(self) -> list[ConnectorEntry]:
        """Return every registered connector, sorted by name."""
        return [self._entries[n] for n in self.names()]

    def __iter__(self) -> Iterator[ConnectorEntry]:
        return iter(self.entries())

    def __len__(self) -> int:
        return len(self._entries)


_default: ConnectorRegistry | None = None
_default_lock = threading.Lock()


def get_registry() -> ConnectorRegistry:
    """Return the default registry, loading the installed plugins on first use.

    Plugins are loaded exactly once per process (see :func:`reset_registry`).
    """
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                registry = ConnectorRegistry()
                registry.load_plugins()
                _default = registry
    return _default


def reset_registry() -> None:
    """Forget the default registry so the next :func:`get_registry` reloads plugins (tests)."""
    global _default
    with _default_lock:
        _default = None


def get_connector_class(
    config: KVConnectorConfig, *, registry: ConnectorRegistry | None = None
) -> type[KVConnectorBase_V1]:
    """Resolve the connector class a config names.

    A ``module_path`` wins over the registry (like vLLM): the module is
    imported and ``config.name`` is taken from it. It is checked first against
    the allow/deny lists (the registry's, or the environment's when no registry
    is given), so an excluded module is never imported; whatever its import
    raises, ``sys.exit()`` included, becomes a :class:`PluginLoadError`.

    Args:
        config: the connector config.
        registry: where to look names up; default: :func:`get_registry`.

    Raises:
        PluginDeniedError: the allow/deny lists exclude ``module_path``.
        PluginLoadError: ``module_path`` cannot be imported.
        UnknownConnectorError: the name is not registered / not in the module.
        DuplicateConnectorError: two classes claim the name.
        InvalidConnectorError: ``module_path``'s attribute is not a connector class.
    """
    if config.module_path:
        return _class_from_module_path(config, config.module_path, registry)
    return (registry if registry is not None else get_registry()).get(config.name)


def _is_concrete_connector(obj: Any) -> bool:
    return (isinstance(obj, type) and issubclass(obj, KVConnectorBase_V1)
            and not inspect.isabstract(obj))


def _class_from_module_path(config: KVConnectorConfig, module_path: str,
                            registry: ConnectorRegistry | None) -> type[KVConnectorBase_V1]:
    """Import ``module_path`` (once the allow/deny lists let it) and take ``config.name``."""
    policy = (registry._module_path_policy() if registry is not None  # noqa: SLF001
              else PluginPolicy.resolve())
    policy.check_module_path(module_path)
    module = run_contained(
        lambda: importlib.import_module(module_path),
        lambda exc: (f"cannot import connector module_path {module_path!r}: "
                     f"{type(exc).__name__}: {exc}"))
    cls = getattr(module, config.name, None)
    if cls is None:
        raise _missing_attribute(config, module, registry)
    if not _is_concrete_connector(cls):
        msg = (
            f"{module_path}.{config.name} is {cls!r}, not a concrete connector class "
            f"(a subclass of KVConnectorBase_V1 implementing every abstract hook)"
        )
        raise InvalidConnectorError(msg)
    connector: type[KVConnectorBase_V1] = cls
    return connector


def _missing_attribute(config: KVConnectorConfig, module: Any,
                       registry: ConnectorRegistry | None) -> UnknownConnectorError:
    """The error for a module_path without ``config.name``, listing the connector classes
    it has and, when ``config.name`` is a registry name or alias of one, its attribute."""
    concrete = {k: v for k, v in vars(module).items() if _is_concrete_connector(v)}
    named = [k for k, v in concrete.items()
             if config.name in (getattr(v, "name", None), *getattr(v, "aliases", ()))
             or v is _registered_class(config.name, registry)]
    hint = (f"; with module_path, name is the class's attribute name in the module, "
            f"not its registry name or alias: use {named[0]!r}" if named else "")
    msg = (f"module {config.module_path!r} has no attribute {config.name!r}; "
           f"connector classes in it: {sorted(concrete) or 'none'}{hint}")
    return UnknownConnectorError(msg)


def _registered_class(name: str, registry: ConnectorRegistry | None) -> type | None:
    """The class ``name`` resolves to in the registry, or None (for an error message only)."""
    try:
        return (registry if registry is not None else get_registry()).get(name)
    except Exception:  # noqa: BLE001 - a hint must never replace the error being reported
        return None


def create_connector(
    config: KVConnectorConfig | dict[str, Any],
    role: KVConnectorRole,
    kv_cache_config: KVCacheConfig | None = None,
    *,
    registry: ConnectorRegistry | None = None,
) -> KVConnectorBase_V1:
    """Create the connector a config names, for one role.

    Args:
        config: a :class:`KVConnectorConfig` or a dict with its fields.
        role: :attr:`KVConnectorRole.SCHEDULER` or :attr:`KVConnectorRole.WORKER`.
        kv_cache_config: the engine's KV cache layout.
        registry: where to look the name up; default: :func:`get_registry`.

    Returns:
        ``cls(config, role, kv_cache_config)``.

    Raises:
        ConfigError: the config dict is invalid.
        RegistryError: see :func:`get_connector_class`.
    """
    config = KVConnectorConfig.from_dict(config)
    cls = get_connector_class(config, registry=registry)
    return cls(config, KVConnectorRole(role), kv_cache_config)
