"""MultiConnector: several connectors behind one, e.g. a TTL pinner + CPU offload.

:class:`MultiConnector` (``connector``) is the facade; its scheduler side
(:class:`~connectors.multi.scheduler.MultiSchedulerSide`) and worker side
(:class:`~connectors.multi.worker.MultiWorkerSide`) fan each hook out to the children
behind their guards, and send each other the records of ``records``. ``config`` holds
the typed ``extra_config``, ``policy`` the choice of the loading child. The semantics
are in :mod:`connectors.multi.connector`.

Names are imported lazily, so that ``import connectors.multi`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvconnector_core._lazy import lazy_exports

if TYPE_CHECKING:
    from connectors.multi.config import ChildConfig, MultiSettings
    from connectors.multi.connector import MultiConnector
    from connectors.multi.policy import (
        LOADER_POLICIES,
        FirstHitPolicy,
        LoaderSelectionPolicy,
        LongestHitPolicy,
    )
    from connectors.multi.records import (
        MultiKVConnectorMetadata,
        MultiKVConnectorWorkerMetadata,
        MultiLoad,
    )

# name -> defining module.
_EXPORTS = {
    "LOADER_POLICIES": "policy",
    "ChildConfig": "config",
    "FirstHitPolicy": "policy",
    "LoaderSelectionPolicy": "policy",
    "LongestHitPolicy": "policy",
    "MultiConnector": "connector",
    "MultiKVConnectorMetadata": "records",
    "MultiKVConnectorWorkerMetadata": "records",
    "MultiLoad": "records",
    "MultiSettings": "config",
}

__all__ = [
    "LOADER_POLICIES",
    "ChildConfig",
    "FirstHitPolicy",
    "LoaderSelectionPolicy",
    "LongestHitPolicy",
    "MultiConnector",
    "MultiKVConnectorMetadata",
    "MultiKVConnectorWorkerMetadata",
    "MultiLoad",
    "MultiSettings",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
