"""Which plugins may load, and running plugin code so that it cannot take the process down.

:class:`PluginPolicy` holds the allow/deny lists (entry-point,
distribution or module names, PEP 503-normalised) and answers both questions the
registry asks: may this entry point load, and may this ``module_path`` be imported. The
module check reads installed metadata only, so a denied module (or any package above it)
is never imported. :func:`run_contained` runs plugin code and turns whatever it raises,
``SystemExit`` and other ``BaseException`` included, into a recorded error.

Primitives: :class:`PluginPolicy`, :func:`run_contained`, :func:`normalize`,
:data:`ENV_PLUGINS_ALLOW`, :data:`ENV_PLUGINS_DENY`, :data:`BUILTIN_PACKAGES`.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from kvconnector_core.errors import PluginDeniedError, PluginLoadError, RegistryError

__all__ = [
    "BUILTIN_PACKAGES",
    "ENV_PLUGINS_ALLOW",
    "ENV_PLUGINS_DENY",
    "PluginPolicy",
    "normalize",
    "run_contained",
]

ENV_PLUGINS_ALLOW = "KVCONNECTOR_PLUGINS_ALLOW"
"""Environment variable: comma-separated plugins allowed to load (third-party only)."""
ENV_PLUGINS_DENY = "KVCONNECTOR_PLUGINS_DENY"
"""Environment variable: comma-separated plugins that must not load."""
BUILTIN_NAMES = frozenset({"builtin", "kvconnector"})
"""Names that select the built-in plugin (its entry point and its distribution)."""
BUILTIN_PACKAGES = frozenset({"connectors", "kvconnector_core"})
"""Top-level packages of the ``kvconnector`` distribution: a module_path in them is built in."""

T = TypeVar("T")


def normalize(name: str) -> str:
    """Normalise a distribution, entry-point or module name (PEP 503) for allow/deny lists."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _env_names(var: str) -> frozenset[str] | None:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    return frozenset(normalize(part) for part in raw.split(",") if part.strip())


@dataclass(frozen=True, slots=True)
class PluginPolicy:
    """Allow and deny lists, already normalised.

    Attributes:
        allowed: third-party plugins allowed to load (None: all).
        denied: plugins that must not load (the built-in one included).
    """

    allowed: frozenset[str] | None = None
    denied: frozenset[str] = frozenset()

    @classmethod
    def resolve(cls, allow: Iterable[str] | None = None,
                deny: Iterable[str] | None = None) -> PluginPolicy:
        """The lists given, or else ``$KVCONNECTOR_PLUGINS_ALLOW`` / ``$KVCONNECTOR_PLUGINS_DENY``.

        Args:
            allow: third-party plugins allowed to load (None: the environment's list).
            deny: plugins that must not load (None: the environment's list).

        Returns:
            The normalised policy.
        """
        allowed = (frozenset(map(normalize, allow)) if allow is not None
                   else _env_names(ENV_PLUGINS_ALLOW))
        denied = (frozenset(map(normalize, deny)) if deny is not None
                  else (_env_names(ENV_PLUGINS_DENY) or frozenset()))
        return cls(allowed, denied)

    def exclusion(self, names: Iterable[str], *, is_builtin: bool) -> str | None:
        """Why a plugin known by ``names`` must not load (None if it may)."""
        keys = {normalize(n) for n in names}
        if keys & self.denied:
            return f"denied by {ENV_PLUGINS_DENY}"
        if self.allowed is not None and not is_builtin and not keys & self.allowed:
            return f"not in {ENV_PLUGINS_ALLOW}"
        return None

    def check_module_path(self, module_path: str) -> None:
        """Refuse a connector ``module_path`` the lists exclude, before anything is imported.

        The module is known by its dotted path, every package above it and the
        distributions installing its top-level package (read from installed metadata,
        which imports nothing). Modules of kvconnector itself count as the built-in
        plugin: only a deny of ``builtin`` / ``kvconnector`` excludes them.

        Raises:
            PluginDeniedError: the module matches the deny list, or an allow list is set
                and the module matches none of it.
        """
        parts = module_path.split(".")
        top = parts[0]
        is_builtin = top in BUILTIN_PACKAGES
        names = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        dists = set(importlib.metadata.packages_distributions().get(top, ()))
        names |= dists | (BUILTIN_NAMES if is_builtin else set())
        reason = self.exclusion(names, is_builtin=is_builtin)
        if reason is None:
            return
        where = f"distribution {', '.join(sorted(dists))}" if dists else "no installed distribution"
        if reason.startswith("denied"):
            hit = sorted(normalize(n) for n in names if normalize(n) in self.denied)
            msg = (f"connector module_path {module_path!r} ({where}) is {reason} (matches "
                   f"{', '.join(hit)}); it was not imported: remove it from {ENV_PLUGINS_DENY} "
                   f"or use another connector")
        else:
            msg = (f"connector module_path {module_path!r} ({where}) is {reason} "
                   f"({', '.join(sorted(self.allowed or ()))}); it was not imported: add "
                   f"{sorted(dists)[0] if dists else top!r} to {ENV_PLUGINS_ALLOW} to allow it")
        raise PluginDeniedError(msg)


def run_contained(call: Callable[[], T], describe: Callable[[BaseException], str]) -> T:
    """Run plugin code; anything it raises becomes a :class:`PluginLoadError`.

    A :class:`RegistryError` (already a described registry problem) passes unchanged.

    ``BaseException`` is caught on purpose: a plugin calling ``sys.exit()`` (or raising
    ``SystemExit`` / ``GeneratorExit`` / its own ``BaseException``) at import must not
    end the CLI or stop the other plugins. ``KeyboardInterrupt`` is the user's, not the
    plugin's, so it propagates.

    Args:
        call: the plugin code.
        describe: builds the error message from the exception.

    Raises:
        PluginLoadError: the code raised; the original exception is its ``__cause__``.
    """
    try:
        return call()
    except (KeyboardInterrupt, RegistryError):
        raise
    except BaseException as exc:  # see the docstring: plugins may raise anything
        raise PluginLoadError(describe(exc)) from exc
