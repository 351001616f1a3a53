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
