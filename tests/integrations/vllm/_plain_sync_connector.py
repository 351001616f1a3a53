"""A synchronous connector with no failure handling of its own (for the adapter suite).

The shape ``docs/writing-a-connector.md`` teaches first (loads in ``start_load_kv``, every
newly full block stored in ``wait_for_save``, a dict as the tier), without the hooks that
drop a failed step's stores (``update_connector_output``, ``plan_failed``): the framework
must keep it from ever serving KV computed on a failed load.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from kvconnector_core.connector import KVConnectorBase_V1, KVConnectorMetadata
from kvconnector_core.connector.planning import StorePlanner


class PlainSyncPlan(KVConnectorMetadata, kw_only=True):
    """One step's plan: (block hash, GPU block id) pairs to load and to store."""

    loads: list[tuple[bytes, int]] = msgspec.field(default_factory=list)
    stores: list[tuple[bytes, int]] = msgspec.field(default_factory=list)


class PlainSyncConnector(KVConnectorBase_V1):
    """Synchronous loads and stores over a dict in the worker; no failure handling."""

    name: ClassVar[str] = "PlainSyncConnector"
    metadata_type: ClassVar[type[KVConnectorMetadata]] = PlainSyncPlan
    has_sync_kv_loads: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.block_size = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.stored: set[bytes] = set()
        self.asked: dict[str, int] = {}
        self.loads: list[tuple[bytes, int]] = []
        self.planner = StorePlanner(self.block_size)
        self.kv: list[Any] = []
        self.blocks: dict[bytes, list[Any]] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        first = num_computed_tokens // self.block_size
        hits = 0
        for block_hash in request.block_hashes[first:]:
            if bytes(block_hash) not in self.stored:
                break
            hits += 1
        self.asked[request.request_id] = num_computed_tokens
        return max(
            0, min(hits * self.block_size, request.num_tokens - 1 - num_computed_tokens)
        ), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        block_ids = blocks.get_block_ids()[0]
        start = self.asked.pop(request.request_id, 0)
        end = -(-(start + num_external_tokens) // self.block_size)
        if num_external_tokens > 0:
            self.loads += [
                (bytes(request.block_hashes[i]), block_ids[i])
                for i in range(start // self.block_size, end)
            ]
        self.planner.admit(request, block_ids, first_block=end)

    def build_connector_meta(self, scheduler_output):
        plan = PlainSyncPlan(loads=self.loads)
        self.loads = []
        for request, index, block_id in self.planner.newly_full(scheduler_output):
            block_hash = bytes(request.block_hashes[index])
            if block_hash not in self.stored:
                self.stored.add(block_hash)
                plan.stores.append((block_hash, block_id))
        return plan

    def request_finished(self, request, block_ids):
        self.planner.forget(request.request_id)
        return False, None

    def register_kv_caches(self, kv_caches):
        self.kv = list(kv_caches.values())

    def start_load_kv(self, forward_context=None):
        for block_hash, block_id in self.get_connector_metadata().loads:
            for tensor, part in zip(self.kv, self.blocks[block_hash]):
                tensor[block_id].copy_(part)

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None):
        pass

    def wait_for_save(self):
        for block_hash, block_id in self.get_connector_metadata().stores:
            self.blocks[block_hash] = [t[block_id].clone() for t in self.kv]

    def get_block_ids_with_load_errors(self):
        return set()
