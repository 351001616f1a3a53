"""A small, real connector for engine tests: keeps KV blocks in a dict keyed by block hash.

It moves real bytes, so any mistake in the engine's connector plumbing (wrong blocks,
stale data, blocks freed while a save still reads them) shows up as different outputs.

extra_config:
    load_async (bool): answer ``load_async=True`` and report loads in ``finished_recving``.
    save_delay (int): a save planned in step ``k`` is copied at the end of step ``k + delay``;
        with ``delay > 0`` ``request_finished`` asks for a delayed free, and the request is
        reported in ``finished_sending`` once its saves are copied.
    sync_flag (bool): the class capability ``has_sync_kv_loads`` (default: ``not load_async``).
        ``False`` with sync loads relies on the scheduler's per-step
        ``SchedulerOutput.has_sync_kv_loads``.
    fail_start_load (int): in the first N steps that have loads, ``start_load_kv`` overwrites
        every load target with garbage and raises (a load that failed half-way).

The scheduler side learns that a save is done by counting steps (the copy happens in the
worker's ``wait_for_save`` of a known step), so the two sides share only the metadata.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import msgspec
import torch

from kvconnector_core.connector.base import KVConnectorBase_V1
from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorTransferResults
from kvconnector_core.scheduler.output import yield_req_data

__all__ = ["InMemoryConnector", "InMemoryMetadata"]


class InMemoryMetadata(KVConnectorMetadata, kw_only=True):
    """Per-step plan: loads and stores as ``(req_id, block_hash, block id per group)``."""

    step: int = 0
    loads: list[tuple[str, bytes, list[int]]] = msgspec.field(default_factory=list)
    stores: list[tuple[str, bytes, list[int]]] = msgspec.field(default_factory=list)
    async_load_reqs: list[str] = msgspec.field(default_factory=list)
    preempted: list[str] = msgspec.field(default_factory=list)
    # forgotten: drop their pending saves
    cancelled: list[str] = msgspec.field(default_factory=list)


class InMemoryConnector(KVConnectorBase_V1):
    """Dict-backed connector (see the module docstring)."""

    name: ClassVar[str] = "InMemoryConnector"
    metadata_type = InMemoryMetadata
    supports_async_load = True
    has_sync_kv_loads = True  # reset per instance from extra_config

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.load_async = bool(self.config.get_from_extra_config("load_async", False))
        self.save_delay = int(self.config.get_from_extra_config("save_delay", 0))
        self.has_sync_kv_loads = bool(
            self.config.get_from_extra_config("sync_flag", not self.load_async)
        )
        self.fail_start_load = int(self.config.get_from_extra_config("fail_start_load", 0))
        cfg = self.kv_cache_config
        self.block_size = cfg.kv_cache_groups[0].kv_cache_spec.block_size
        # scheduler side
        self._step = 0
        self._available_at: dict[bytes, int] = {}
        self._matched: dict[str, int] = {}
        self._reqs: dict[str, dict[str, Any]] = {}
        self._loads: list[tuple[str, bytes, list[int]]] = []
        self._async_reqs: list[str] = []
        self._last_stores: list[tuple[str, bytes, list[int]]] = []
        self._unfinished_stores: list[tuple[str, bytes, int]] = []  # (req, key, ready at step)
        self._cancelled: list[str] = []  # forgotten requests the worker must drop saves of
        # worker side
        self._views: list[torch.Tensor] = []
        self._store: dict[bytes, list[torch.Tensor]] = {}
        self._store_due: dict[bytes, int] = {}  # the step each stored key's copy was due
        self._pending: list[tuple[int, str, bytes, list[int]]] = []
        self._recving: set[str] = set()
        self._finished: set[str] = set()
        self._stats: dict[str, float] = {}

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        bs = self.block_size
        limit = (request.num_tokens - 1) // bs
        n = 0
        for i in range(num_computed_tokens // bs, min(limit, len(request.block_hashes))):
            ready = self._available_at.get(bytes(request.block_hashes[i]))
            if ready is None or ready > self._step:
                break
            n += 1
        self._matched[request.request_id] = num_computed_tokens
        return n * bs, bool(n) and self.load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        rid = request.request_id
        self._reqs[rid] = {
            "request": request,
            "blocks": [list(g) for g in blocks.get_block_ids()],
            "next_store": 0,
            "last_store": -1,
        }
        if num_external_tokens <= 0:
            return
        local = self._matched[rid] // self.block_size
        ids = blocks.get_block_ids()
        for i in range(local, local + num_external_tokens // self.block_size):
            self._loads.append((rid, bytes(request.block_hashes[i]), [g[i] for g in ids]))
        # Loaded blocks need not be stored again.
        self._reqs[rid]["next_store"] = local + num_external_tokens // self.block_size
        if self.load_async:
            self._async_reqs.append(rid)

    def build_connector_meta(self, scheduler_output):
        meta = InMemoryMetadata(
            step=self._step,
            loads=self._loads,
            async_load_reqs=self._async_reqs,
            preempted=sorted(scheduler_output.preempted_req_ids),
            cancelled=self._cancelled,
        )
        new_ids_of = {n.req_id for n in scheduler_output.scheduled_new_reqs}
        computed = {n.req_id: n.num_computed_tokens for n in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, new_ids, resumed in yield_req_data(scheduler_output):
            state = self._reqs.get(rid)
            if state is None:
                continue
            if resumed or rid in new_ids_of:  # the full block list: replace
                state["blocks"] = [list(g) for g in new_ids]
            else:
                for g, added in zip(state["blocks"], new_ids):
                    g.extend(added)
            req = state["request"]
            done = computed[rid] + scheduler_output.num_scheduled_tokens.get(rid, 0)
            full = min(done // self.block_size, len(req.block_hashes))
            for i in range(state["next_store"], full):
                key = bytes(req.block_hashes[i])
                block_ids = [g[i] for g in state["blocks"]]
                if key in self._available_at or 0 in block_ids:
                    continue
                self._available_at[key] = self._step + self.save_delay + 1
                self._unfinished_stores.append((rid, key, self._available_at[key]))
                meta.stores.append((rid, key, block_ids))
                state["last_store"] = self._step
            state["next_store"] = max(state["next_store"], full)
        self._loads, self._async_reqs, self._cancelled = [], [], []
        self._last_stores = list(meta.stores)
        self._step += 1
        return meta

    def update_connector_output(self, connector_output):
        """Forget this step's saves of requests that read invalid blocks (a failed sync load).

        Those requests computed this step's KV on garbage, and the worker saved it: serving
        it later would be wrong. The request rolls back and recomputes, and its blocks are
        saved again from the first invalid one.
        """
        # The worker reports each step once: the step's stores are only needed now.
        last, self._last_stores = self._last_stores, []
        self._unfinished_stores = [s for s in self._unfinished_stores if s[2] > self._step]
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for rid, key, _ in last:
            state = self._reqs.get(rid)
            if state is None or not any(b in invalid for g in state["blocks"] for b in g):
                continue
            self._available_at.pop(key, None)
            first_bad = min(i for g in state["blocks"] for i, b in enumerate(g) if b in invalid)
            state["next_store"] = min(state["next_store"], first_bad)

    def forget_requests(self, request_ids):
        """Drop everything kept for these requests: loads not yet sent, stores not yet
        complete (never visible; the worker is told to drop their pending copies), and
        the request itself, so nothing delays its free (a store still reading its blocks
        is invisible, and a late stale copy never replaces a newer one)."""
        self._loads = [load for load in self._loads if load[0] not in request_ids]
        self._async_reqs = [r for r in self._async_reqs if r not in request_ids]
        for rid in request_ids:
            self._reqs.pop(rid, None)
            self._matched.pop(rid, None)
        self._cancelled += sorted(set(request_ids) - set(self._cancelled))
        self._drop_stores({key for rid, key, _ in self._unfinished_stores if rid in request_ids})

    def plan_failed(self, connector_metadata, *, loads_failed, stores_failed):
        """A plan whose stores failed: they never become visible (loads hold nothing here),
        and the cancellations it carried are sent again."""
        if stores_failed:
            self._drop_stores({key for _, key, _ in connector_metadata.stores})
            self._cancelled += [r for r in connector_metadata.cancelled if r not in self._cancelled]

    def _drop_stores(self, keys) -> None:
        for key in keys:
            self._available_at.pop(key, None)
        self._unfinished_stores = [s for s in self._unfinished_stores if s[1] not in keys]

    def request_finished(self, request, block_ids):
        state = self._reqs.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        # Saves planned in the last save_delay steps still read this request's blocks.
        busy = (
            state is not None
            and state["last_store"] >= 0
            and state["last_store"] + self.save_delay >= self._step - 1
            and self.save_delay > 0
        )
        return busy, None

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches):
        from kvconnector_core.worker.kv_cache import cross_layer_block_view, group_layers_by_storage

        self._views = [cross_layer_block_view(g) for g in group_layers_by_storage(kv_caches)]
        assert all(v is not None for v in self._views)

    def start_load_kv(self, forward_context=None):
        meta = self._get_connector_metadata()
        if meta.loads and self.fail_start_load > 0:
            self.fail_start_load -= 1
            for _, _, block_ids in meta.loads:
                for view, block_id in zip(self._views, block_ids):
                    view[block_id].fill_(7)
            raise RuntimeError(f"injected start_load_kv failure (step {meta.step})")
        t0 = time.perf_counter()
        for _, key, block_ids in meta.loads:
            for view, block_id, data in zip(self._views, block_ids, self._store[key]):
                view[block_id].copy_(data)
                self._add("bytes_loaded", data.numel())
        self._add("load_seconds", time.perf_counter() - t0)
        self._recving.update(meta.async_load_reqs)

    def handle_preemptions(self, connector_metadata):
        """Copy the pending saves of preempted requests now: their blocks are reused this step."""
        self._copy_pending(lambda due, rid: rid in connector_metadata.preempted)

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None):
        pass

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        if meta.cancelled:
            self._pending = [p for p in self._pending if p[1] not in meta.cancelled]
        for rid, key, block_ids in meta.stores:
            self._pending.append((meta.step + self.save_delay, rid, key, block_ids))
        self._copy_pending(lambda due, rid: due <= meta.step)

    def _copy_pending(self, ready) -> None:
        t0 = time.perf_counter()
        keep = []
        for due, rid, key, block_ids in self._pending:
            if not ready(due, rid):
                keep.append((due, rid, key, block_ids))
                continue
            if self._store_due.get(key, -1) > due:
                continue  # a stale copy (its store was dropped) never replaces a newer one
            self._store_due[key] = due
            self._store[key] = [view[b].clone() for view, b in zip(self._views, block_ids)]
            self._add("bytes_stored", sum(v[b].numel() for v, b in zip(self._views, block_ids)))
        self._pending = keep
        self._add("store_seconds", time.perf_counter() - t0)

    def get_transfer_results(self, finished_req_ids):
        self._finished |= finished_req_ids
        busy = {rid for _, rid, _, _ in self._pending}
        sending = {rid for rid in self._finished if rid not in busy}
        self._finished -= sending
        recving, self._recving = self._recving, set()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving)

    def get_kv_connector_stats(self):
        stats, self._stats = self._stats, {}
        return stats or None

    def has_pending_work(self):
        """Scheduler side: cancellations not sent yet; worker side: saves not copied yet."""
        return bool(self._cancelled or self._pending)

    def _add(self, key: str, value: float) -> None:
        self._stats[key] = self._stats.get(key, 0) + value
