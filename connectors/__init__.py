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

from typing import TYPE_CHECKING

from kvconnector_core._lazy import lazy_exports

if TYPE_CHECKING:
    from connectors.multi.connector import MultiConnector
    from connectors.multi.policy import LoaderSelectionPolicy, LongestHitPolicy
    from connectors.offload.connector import OffloadingConnector

__all__ = ["LoaderSelectionPolicy", "LongestHitPolicy", "MultiConnector", "OffloadingConnector"]

# name -> defining submodule. Imported on first use, which keeps `import connectors` free
# of torch.
_LAZY = {
    "LoaderSelectionPolicy": "multi.policy",
    "LongestHitPolicy": "multi.policy",
    "MultiConnector": "multi.connector",
    "OffloadingConnector": "offload.connector",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__)
