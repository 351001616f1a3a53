"""Old home of the role interfaces and RoleSplitConnector; they live in ``base``."""

# compat: removed after the restructure merge
from __future__ import annotations

from kvconnector_core.connector.base import (
    KVConnectorSchedulerSide,
    KVConnectorWorkerSide,
    RoleSplitConnector,
)

__all__ = ["KVConnectorSchedulerSide", "KVConnectorWorkerSide", "RoleSplitConnector"]
