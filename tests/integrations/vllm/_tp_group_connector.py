"""vLLM's ExampleConnector, reading vLLM's TP group while its worker side is built (as
LMCache and sparkcache do): vLLM's worker sets up its process groups before it builds its
connector, so the rig must too."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.distributed.parallel_state import get_tp_group


class TPGroupConnector(ExampleConnector):
    """ExampleConnector that records its TP rank from vLLM's process group."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.WORKER:
            self.tp_rank = get_tp_group().rank_in_group
