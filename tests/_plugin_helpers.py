"""Fake entry points and plugin modules for the registry tests."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

from kvconnector_core.connector import hookimpl

__all__ = ["FakeDist", "FakeEntryPoint", "ep", "plugin"]


@dataclass
class FakeDist:
    """Quacks like importlib.metadata.Distribution (name and version only)."""

    name: str
    version: str = "1.0"


@dataclass
class FakeEntryPoint:
    """Quacks like importlib.metadata.EntryPoint.

    ``load()`` raises ``target`` when it is an exception, calls it when it is a plain
    function (to run code at "import" time, e.g. ``sys.exit()``), else returns it.
    """

    name: str
    value: str
    target: Any
    dist: FakeDist | None = None
    group: str = "kvconnector"

    def load(self) -> Any:
        if isinstance(self.target, BaseException):
            raise self.target
        if isinstance(self.target, types.FunctionType):
            return self.target()
        return self.target


def plugin(*classes: type, aliases: tuple[str, ...] = ()) -> types.ModuleType:
    """A plugin module whose hook registers ``classes``."""
    mod = types.ModuleType("fake_plugin")

    @hookimpl
    def kvconnector_register_connectors(registry):
        for cls in classes:
            registry.add(cls, aliases=aliases)

    mod.kvconnector_register_connectors = kvconnector_register_connectors
    return mod


def ep(name: str, target: Any, dist: str = "dist-a") -> FakeEntryPoint:
    """An entry point ``name`` of distribution ``dist`` 1.0."""
    return FakeEntryPoint(name, f"{name}_mod", target, FakeDist(dist))
