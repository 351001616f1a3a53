"""``TransferStats``: the stats keys the engine's report understands, as a typed record.

``get_kv_connector_stats`` returns what happened *since the previous call*: the engine
calls it once per step on each side and sums the numbers over the run. Keep a
:class:`TransferStats` on the worker side, add to it as blocks move, and return
``self.stats.take()``, which hands out the counts and starts again from zero::

    from kvconnector_core.connector.stats import TransferStats

    self.stats = TransferStats()                      # worker side, in __init__
    self.stats.add_load(num_bytes, seconds)           # after a load
    def get_kv_connector_stats(self):
        return self.stats.take(blocks_loaded=n)       # extra keys of your own are kept

Primitives: :class:`TransferStats`.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["TransferStats"]


class TransferStats(msgspec.Struct, kw_only=True):
    """Bytes and seconds moved since the last :meth:`take` (all start at 0).

    Attributes:
        bytes_loaded: bytes copied into GPU blocks (the report's ``bytes_loaded`` and
            ``load_gbps``; the timeline's ``<tier>.loaded``).
        bytes_stored: bytes copied out of GPU blocks (``bytes_stored``, ``store_gbps``,
            ``<tier>.stored``).
        load_seconds: time spent loading (without it the report's ``load_gbps`` is 0).
        store_seconds: time spent storing (likewise for ``store_gbps``).
    """

    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0

    def add_load(self, num_bytes: int, seconds: float = 0.0) -> None:
        """Count one load of ``num_bytes`` that took ``seconds``."""
        self.bytes_loaded += num_bytes
        self.load_seconds += seconds

    def add_store(self, num_bytes: int, seconds: float = 0.0) -> None:
        """Count one store of ``num_bytes`` that took ``seconds``."""
        self.bytes_stored += num_bytes
        self.store_seconds += seconds

    def take(self, **extra: float) -> dict[str, Any] | None:
        """The counts since the last call plus ``extra``, as a stats dict (None when all are
        zero); the counts start again from zero."""
        stats = {k: v for k, v in msgspec.structs.asdict(self).items() if v}
        stats.update({k: v for k, v in extra.items() if v})
        self.bytes_loaded = self.bytes_stored = 0
        self.load_seconds = self.store_seconds = 0.0
        return stats or None
