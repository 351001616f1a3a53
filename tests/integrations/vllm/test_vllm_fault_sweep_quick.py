"""A quick subset of ``benchmarks/vllm_fault_sweep.py`` (the fault sweep inside vLLM): one
seed of every (connector, fault) cell, every damage column at 0."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import vllm_fault_sweep as sweep

QUICK_SEED = 2  # one seed of every cell (the full sweep: benchmarks/RESULTS.md)


@pytest.fixture(autouse=True)
def _cached_distributions(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "packages_distributions",
                        importlib.metadata.packages_distributions)
    sweep.cache_distributions()


@pytest.mark.parametrize("connector", sweep.CONNECTORS)
def test_quick_sweep_does_no_damage(connector):
    runs = [sweep.run_one(connector, fault, QUICK_SEED) for fault in sweep.FAULTS]
    assert [r for r in runs if r.failed] == []
    assert sum(r.layer_blocks_checked for r in runs) > 0


@pytest.mark.parametrize("seed", [23, 24])
def test_two_workers_behind_the_fault_injector_load_their_own_disk_shards(seed):
    """cpu_offload with a disk tier behind the FaultInjector, under two vLLM workers: each
    worker runs as its own rank, so each loads its own shard (when the wrapped connector
    ran as rank 0 of 1 in both, these seeds loaded the other worker's shard in 5 of 6
    runs; deterministic cases: tests/connectors/tiers/test_tiers_tp.py)."""
    run = sweep.run_one("offload_disk", "late", seed)
    assert run.settings.startswith("sync-sched") and "2w hybrid" in run.settings
    assert run.failed == [], run.detail
