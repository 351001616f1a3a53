"""A reference connector that moves real KV data, with bugs that can be planted one at a time.

The data kit (``kvconnector_core.testing.DataCheck``) must pass the correct connector and
fail every planted bug. Blocks live in a dict keyed by block hash; the worker copies
whole blocks (every layer, K and V) with one copy through ``cross_layer_block_view``.

extra_config:
    load_async (bool): answer ``load_async=True``; loads are reported in ``finished_recving``.
    claim_whole_prompt (bool): when every block of a block-aligned prompt is stored, claim
        the whole prompt (the engine still computes the last token). Default: claim at
        most ``num_tokens - 1`` (what vLLM 0.33 needs for synchronous loads), so the claim
        ends inside the last block, which must then be loaded too.
    fail_last_block (bool): every load reports its last block as failed (in
        ``get_block_ids_with_load_errors``) instead of loading it: a partial failure the
        engine must recover from by recomputing only that block.
    raise_in_lookup (bool): ``get_num_new_matched_tokens`` raises (the engine contains it).
    bug (str | None): one of :data:`BUGS`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
import torch

from kvconnector_core.connector.base import KVConnectorBase_V1, KVConnectorRole
from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorTransferResults
from kvconnector_core.connector.planning import StorePlanner

__all__ = [
    "BUGS",
    "FalseHybridReferenceConnector",
    "HitCountingReferenceConnector",
    "OneShotLookupReferenceConnector",
    "ReferenceConnector",
    "ReferenceMetadata",
    "UndeclaredAsyncReferenceConnector",
]

BUGS = ("wrong_block", "corrupt_value", "over_claim", "empty_store_claim", "partial_last_block",
        "zero_last_byte", "serve_failed_load_stores")
"""Planted bugs: load another block's data; change one value per loaded block; claim one
block more than stored; claim a hit while nothing is stored; skip the block in which the
claim ends when it ends mid-block (these three ignore the missing data silently); load
every block with its last byte zeroed (the high byte of its last KV element); keep the
stores of a step whose synchronous load failed (its forward ran on blocks never loaded): the
worker copies a step's stores a step late, when the next plan is bound, which the guard's
skipped saves cannot stop, and the scheduler side ignores the failure reports that would
drop them."""


class ReferenceMetadata(KVConnectorMetadata, kw_only=True):
    """One step's plan: ``(block hash, GPU block id)`` to load and to store."""

    loads: list[tuple[bytes, int]] = msgspec.field(default_factory=list)
    stores: list[tuple[bytes, int]] = msgspec.field(default_factory=list)
    async_reqs: list[str] = msgspec.field(default_factory=list)
    failed: list[int] = msgspec.field(default_factory=list)


class ReferenceConnector(KVConnectorBase_V1):
    """Dict-backed data-moving connector (see the module docstring)."""

    name: ClassVar[str] = "ReferenceConnector"
    metadata_type = ReferenceMetadata
    supports_async_load = True
    has_sync_kv_loads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self.config.extra_config
        self.load_async = bool(extra.get("load_async", False))
        self.has_sync_kv_loads = not self.load_async
        self.claim_whole_prompt = bool(extra.get("claim_whole_prompt", False))
        self.fail_last_block = bool(extra.get("fail_last_block", False))
        self.raise_in_lookup = bool(extra.get("raise_in_lookup", False))
        self.bug = extra.get("bug")
        if self.bug is not None and self.bug not in BUGS:
            raise ValueError(f"bug={self.bug!r}; valid: {BUGS}")
        self.block_size = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        # scheduler side
        self._stored: set[bytes] = set()
        self._matched: dict[str, int] = {}
        self._planner = StorePlanner(self.block_size)
        self._plan = ReferenceMetadata()
        self._loading: dict[str, set[int]] = {}  # request id -> GPU blocks it loads, this step
        self._step_loading: dict[str, set[int]] = {}  # the same, of the last plan
        self._step_stores: dict[str, list[bytes]] = {}  # request id -> keys the last plan stores
        # worker side
        self._view: torch.Tensor | None = None
        self._store: dict[bytes, torch.Tensor] = {}
        self._recving: set[str] = set()
        self._errors: set[int] = set()
        self._stats: dict[str, float] = {}

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self.raise_in_lookup:
            raise RuntimeError("ReferenceConnector: raise_in_lookup is set")
        bs, hashes = self.block_size, request.block_hashes
        start = num_computed_tokens // bs
        n = 0
        while start + n < len(hashes) and bytes(hashes[start + n]) in self._stored:
            n += 1
        if self.bug == "over_claim" and n:
            n = min(n + 1, len(hashes) - start)
        if self.bug == "empty_store_claim" and not self._stored:
            n = len(hashes) - start
        tokens = n * bs
        if not self.claim_whole_prompt:
            tokens = min(tokens, request.num_tokens - 1 - num_computed_tokens)
        self._matched[request.request_id] = num_computed_tokens
        return max(tokens, 0), self.load_async and tokens > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        bs, rid = self.block_size, request.request_id
        ids = list(blocks.get_block_ids()[0])
        local = self._matched.pop(rid, 0)
        end = local + num_external_tokens
        # Every block the claim touches, the one it ends in included.
        last = end // bs if self.bug == "partial_last_block" else -(-end // bs)
        self._planner.admit(request, ids, first_block=last)
        if num_external_tokens <= 0:
            return
        keys = [bytes(request.block_hashes[i]) for i in range(local // bs, last)]
        if self.bug == "wrong_block" and len(keys) > 1:
            keys = keys[1:] + keys[:1]
        loads = [(key, ids[i]) for i, key in zip(range(local // bs, last), keys)]
        self._loading[rid] = {block_id for _, block_id in loads}
        if self.fail_last_block:
            self._plan.failed.append(loads.pop()[1])
        self._plan.loads += loads
        if self.load_async:
            self._plan.async_reqs.append(rid)

    def build_connector_meta(self, scheduler_output):
        self._step_stores = {}
        for request, index, block_id in self._planner.newly_full(scheduler_output):
            key = bytes(request.block_hashes[index])
            if key not in self._stored:
                self._stored.add(key)  # the worker copies it in this step's wait_for_save
                self._plan.stores.append((key, block_id))
                self._step_stores.setdefault(request.request_id, []).append(key)
        self._step_loading, self._loading = self._loading, {}
        plan, self._plan = self._plan, ReferenceMetadata()
        return plan

    def update_connector_output(self, connector_output):
        # A failed sync load: the forward of that request ran on blocks never loaded, so
        # what the request stored in the step holds wrong KV and must not be served.
        invalid = set(connector_output.invalid_block_ids)
        if self.bug == "serve_failed_load_stores" or not (invalid or connector_output.loads_failed):
            return
        for rid, blocks in self._step_loading.items():
            if connector_output.loads_failed or blocks & invalid:
                self._stored.difference_update(self._step_stores.get(rid, ()))

    def plan_failed(self, connector_metadata, *, loads_failed, stores_failed):
        if (stores_failed or loads_failed) and self.bug != "serve_failed_load_stores":
            self._stored.difference_update(key for key, _ in connector_metadata.stores)

    def request_finished(self, request, block_ids):
        self._planner.forget(request.request_id)
        self._matched.pop(request.request_id, None)
        return False, None

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches):
        from kvconnector_core.worker.kv_cache import cross_layer_block_view, group_layers_by_storage

        self._view = cross_layer_block_view(group_layers_by_storage(kv_caches)[0])

    def start_load_kv(self, forward_context=None):
        meta = self.get_connector_metadata()
        for key, block_id in meta.loads:
            data = self._store.get(key)
            if data is None:
                continue  # only the planted bugs claim what is not stored
            if self.bug == "corrupt_value":
                data = data.clone()
                data[0] ^= 1
            if self.bug == "zero_last_byte":
                data = data.clone()
                data[-1] = 0
            self._view[block_id].copy_(data)
            self._add("bytes_loaded", data.numel())
        self._recving.update(meta.async_reqs)
        self._errors.update(meta.failed)

    def get_block_ids_with_load_errors(self):
        errors, self._errors = self._errors, set()
        return errors

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None):
        pass

    def bind_connector_metadata(self, connector_metadata):
        if self.bug == "serve_failed_load_stores":
            # the previous step's stores, copied now: a step late
            for key, block_id in getattr(self, "_late_stores", ()):
                self._store[key] = self._view[block_id].clone()
            self._late_stores = list(connector_metadata.stores)
        super().bind_connector_metadata(connector_metadata)

    def wait_for_save(self):
        if self.bug == "serve_failed_load_stores":
            return  # copied when the next plan is bound
        for key, block_id in self.get_connector_metadata().stores:
            self._store[key] = self._view[block_id].clone()
            self._add("bytes_stored", self._store[key].numel())

    def get_transfer_results(self, finished_req_ids):
        recving, self._recving = self._recving, set()
        return KVConnectorTransferResults(finished_recving=recving)

    def get_kv_connector_stats(self):
        stats, self._stats = self._stats, {}
        return stats or None

    def _add(self, key: str, value: float) -> None:
        self._stats[key] = self._stats.get(key, 0) + value


class FalseHybridReferenceConnector(ReferenceConnector):
    """The reference connector claiming hybrid support it lacks: it stores and loads group 0
    only, so on a model with several KV cache groups the other groups' loaded blocks are
    never written (what the kit's ``hybrid`` workload must catch)."""

    name: ClassVar[str] = "FalseHybridReferenceConnector"
    supports_multiple_kv_cache_groups: ClassVar[bool] = True


class OneShotLookupReferenceConnector(ReferenceConnector):
    """The reference connector with a lookup that is not repeatable: a hit is handed out
    once per request, so asking again (as vLLM does for a request that stays waiting)
    answers a miss."""

    name: ClassVar[str] = "OneShotLookupReferenceConnector"

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if n and request.request_id in getattr(self, "_handed_out", set()):
            return 0, False
        self._handed_out = getattr(self, "_handed_out", set()) | (
            {request.request_id} if n else set()
        )
        return n, load_async


class UndeclaredAsyncReferenceConnector(ReferenceConnector):
    """The reference connector answering ``load_async=True`` without declaring it."""

    name: ClassVar[str] = "UndeclaredAsyncReferenceConnector"
    supports_async_load: ClassVar[bool] = False


class HitCountingReferenceConnector(ReferenceConnector):
    """The reference connector counting hits in its lookup (a side effect that never changes
    an answer, but doubles the count when vLLM asks again)."""

    name: ClassVar[str] = "HitCountingReferenceConnector"

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if n:
            self._hits = getattr(self, "_hits", 0) + 1
        return n, load_async

    def get_kv_connector_stats(self):
        stats = dict(super().get_kv_connector_stats() or {})
        if self.role == KVConnectorRole.SCHEDULER and getattr(self, "_hits", 0):
            stats["lookup_hits"], self._hits = self._hits, 0
        return stats or None
