"""A secondary tier that is down logs the first failure of each kind, not every one."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from connectors.offload.tiers import SecondaryTier
from connectors.offload.tiers.base import TierKey


class _Flaky(SecondaryTier):
    """A tier whose backend fails while ``down`` is set (in memory otherwise)."""

    medium = "FLAKY"

    def __init__(self) -> None:
        super().__init__(io_threads=1)
        self.down = True
        self.data: dict[TierKey, bytes] = {}

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("connection refused")

    def _held(self, keys: Sequence[TierKey]) -> list[bool]:
        self._check()
        return [k in self.data for k in keys]

    def _put(self, items) -> None:
        self._check()
        for key, parts in items:
            self.data[key] = b"".join(bytes(p) for p in parts)

    def _get(self, keys: Sequence[TierKey]) -> list[bytes | None]:
        self._check()
        return [self.data.get(k) for k in keys]

    def _close(self) -> None:
        pass


def _key(i: int) -> TierKey:
    return TierKey(i.to_bytes(32, "big"))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_tier_that_is_down_logs_once_per_kind_and_counts_every_failure(caplog):
    caplog.set_level(logging.DEBUG, logger="connectors.offload.tiers.base")
    tier = _Flaky()
    try:
        for i in range(5):
            tier.store([(_key(i), b"x" * 8)])
            assert tier.flush(10)
            tier.load([_key(i)]).values(10)
            while tier.lookup([_key(i)], token=i) is None:
                pass
        warned = _warnings(caplog)
        assert len(warned) == 3, warned  # one store, one load, one lookup
        assert all("further" in w and "connection refused" in w for w in warned)
        stats = tier.stats()
        assert (stats["flaky_store_failures"], stats["flaky_load_failures"],
                stats["flaky_lookup_failures"]) == (5, 5, 5)
        # Back up: a success resets the run, so the next outage is logged again.
        tier.down = False
        tier.store([(_key(9), b"y" * 8)])
        assert tier.flush(10)
        tier.down = True
        caplog.clear()
        tier.store([(_key(10), b"z" * 8)])
        assert tier.flush(10)
        assert ["store of 1 values failed" in w for w in _warnings(caplog)] == [True]
    finally:
        tier.close()
