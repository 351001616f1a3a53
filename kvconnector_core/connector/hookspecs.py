"""Old home of the plugin hooks; they live in :mod:`kvconnector_core.plugins.hookspecs`."""

# compat: removed after the restructure merge
from __future__ import annotations

from kvconnector_core.plugins.hookspecs import (
    PROJECT_NAME,
    hookimpl,
    hookspec,
    kvconnector_register_connectors,
)

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec", "kvconnector_register_connectors"]
