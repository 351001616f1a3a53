"""Built-in connectors of kvconnector.

- :class:`MultiConnector` (``connectors.multi``): composes several connectors.
- ``OffloadingConnector`` (``connectors.offload``): CPU offload tier, alias
  ``cpu_offload``; imported only when the name is first used, since its worker
  side needs torch.

The connectors are registered with the registry by the built-in plugin
``connectors._plugin`` (entry point ``builtin`` in group ``kvconnector``),
through the same hook third-party plugins use. Importing this package does not
import torch and registers nothing.

Note: PyPI has an unrelated distribution named ``connectors``; third-party code
should create connectors by name through ``kvconnector_core`` rather than
import this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connectors.multi import LoaderSelectionPolicy, LongestHitPolicy, MultiConnector
    from connectors.offload.connector import OffloadingConnector

__all__ = ["LoaderSelectionPolicy", "LongestHitPolicy", "MultiConnector", "OffloadingConnector"]

_LAZY: dict[str, str] = {
    "LoaderSelectionPolicy": "connectors.multi",
    "LongestHitPolicy": "connectors.multi",
    "MultiConnector": "connectors.multi",
    "OffloadingConnector": "connectors.offload.connector",
}


def __getattr__(name: str) -> Any:
    # Lazy attributes (PEP 562) keep `import connectors` free of torch.
    module_path = _LAZY.get(name)
    if module_path is None:
        msg = f"module 'connectors' has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(importlib.import_module(module_path), name)


def __dir__() -> list[str]:
    return sorted(__all__)
