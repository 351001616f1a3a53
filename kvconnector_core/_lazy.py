"""Lazy package exports (PEP 562), shared by the packages that re-export from private modules.

A package that re-exports heavy names (torch-backed movers, Redis clients) from its
modules should not import them all when the package is imported; it declares
``name -> module`` and lets :func:`lazy_exports` build its ``__getattr__`` and ``__dir__``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from importlib import import_module
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str], public: Sequence[str]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` for ``package``.

    Args:
        package: the package's ``__name__``.
        exports: exported name -> the submodule (relative to ``package``) defining it.
        public: the package's ``__all__``, which ``dir()`` lists.
    """

    def __getattr__(name: str) -> Any:  # noqa: N807 - module-level __getattr__ (PEP 562)
        module = exports.get(name)
        if module is None:
            msg = f"module {package!r} has no attribute {name!r}"
            raise AttributeError(msg)
        return getattr(import_module(f"{package}.{module}"), name)

    def __dir__() -> list[str]:  # noqa: N807 - module-level __dir__ (PEP 562)
        return list(public)

    return __getattr__, __dir__
