"""Old home of :class:`GuardBase`; it lives in :mod:`kvconnector_core.connector.guard`."""

# compat: removed after the restructure merge
from __future__ import annotations

from kvconnector_core.connector.guard import MAX_PENDING_STEPS, GuardBase

__all__ = ["MAX_PENDING_STEPS", "GuardBase"]
