"""MultiConnector children inherit world_size.

With world_size 1 a cpu_offload child would complete a store after one worker's report,
before the other TP/PP ranks had copied theirs. (Children inherit the rank too: see
tests/connectors/tiers/test_tiers_tp.py.)
"""

from __future__ import annotations

from connectors.multi import MultiConnector
from kvconnector_core.connector.base import KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.engine.engine import EngineConfig


def _multi_config(tmp_path, tiers: bool) -> KVConnectorConfig:
    extra = {"num_cpu_blocks": 8}
    if tiers:
        extra["tiers"] = [{"type": "disk", "path": str(tmp_path / "t"), "capacity_bytes": 1 << 20}]
    return KVConnectorConfig(name="MultiConnector", world_size=2, extra_config={"connectors": [
        {"name": "cpu_offload", "extra_config": extra}]})


def test_children_get_the_multis_world_size(tmp_path) -> None:
    kv = EngineConfig(num_gpu_blocks=64, max_model_len=256).kv_cache_config()
    multi = MultiConnector(_multi_config(tmp_path, tiers=False), KVConnectorRole.SCHEDULER, kv)
    try:
        child = multi.scheduler_side.guards[0].connector
        assert child.config.world_size == 2
    finally:
        multi.shutdown()


def test_a_ready_child_config_runs_as_the_multis_worker(tmp_path) -> None:
    """A child given as a ready KVConnectorConfig (e.g. the kit's fault_injection_config)
    keeps its own fields but runs as the worker the engine built: with world size 1 and
    rank 0 of its defaults, every rank's disk tier would share one shard's keys."""
    from kvconnector_core.testing.faults import fault_injection_config

    kv = EngineConfig(num_gpu_blocks=64, max_model_len=256).kv_cache_config()
    ready = fault_injection_config(KVConnectorConfig(name="cpu_offload", role="kv_producer",
                                                     extra_config={"num_cpu_blocks": 8}))
    cfg = KVConnectorConfig(name="MultiConnector", world_size=4, rank=3,
                            pipeline_parallel_size=2, extra_config={"connectors": [ready]})
    multi = MultiConnector(cfg, KVConnectorRole.WORKER, kv)
    try:
        child = multi.worker_side.guards[0].connector
        assert (child.config.world_size, child.config.rank,
                child.config.pipeline_parallel_size) == (4, 3, 2)
        assert child.config.role == "kv_producer"  # the ready config's own field
        inner = child.inner.config
        assert (inner.world_size, inner.rank, inner.pipeline_parallel_size) == (4, 3, 2)
    finally:
        multi.shutdown()


def test_a_child_cannot_set_another_worker(tmp_path) -> None:
    import pytest

    from kvconnector_core.errors import ConfigError

    kv = EngineConfig(num_gpu_blocks=64, max_model_len=256).kv_cache_config()
    cfg = KVConnectorConfig(name="MultiConnector", world_size=2, rank=1, extra_config={
        "connectors": [{"name": "cpu_offload", "rank": 0, "extra_config": {"num_cpu_blocks": 8}}]})
    with pytest.raises(ConfigError, match=r"\[0\]: rank=0, but .* the engine's \(1\)"):
        MultiConnector(cfg, KVConnectorRole.WORKER, kv)
