"""TransferStats: per-call deltas with the key names the engine's report understands."""

from __future__ import annotations

from kvconnector_core.connector.stats import TransferStats
from kvconnector_core.engine.engine import STANDARD_STATS_KEYS


def test_take_returns_the_counts_since_the_last_call_and_resets() -> None:
    stats = TransferStats()
    assert stats.take() is None
    stats.add_load(4096, 0.5)
    stats.add_store(1024, 0.25)
    stats.add_store(1024)
    assert stats.take(blocks_loaded=2) == {
        "bytes_loaded": 4096,
        "load_seconds": 0.5,
        "bytes_stored": 2048,
        "store_seconds": 0.25,
        "blocks_loaded": 2,
    }
    assert stats.take() is None  # a second call in the same step reports nothing twice


def test_field_names_are_the_reports_standard_keys() -> None:
    assert set(TransferStats.__struct_fields__) == set(STANDARD_STATS_KEYS)
