"""The fault injector's scheduler-side hooks: drawing load and store failures, and checking
that no lookup claims a block whose store failed (see :mod:`kvconnector_core.testing.faults`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from kvconnector_core.connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    decode_metadata,
    encode_metadata,
)
from kvconnector_core.testing._fault_base import FaultMetadata, _FaultBase
from kvconnector_core.testing.fault_settings import FailedStoreHit

if TYPE_CHECKING:
    from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

# Steps whose completed blocks are remembered, so a plan reported failed later
# (``plan_failed``) can mark its stores failed.
_REMEMBERED_STEPS = 32


class _SchedulerFaults(_FaultBase):
    """The scheduler-side hooks of ``FaultInjectingConnector``."""

    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:
        """Forward (or raise)."""
        self._maybe_raise("bind_gpu_block_pool")
        self.inner.bind_gpu_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Forward (or raise); record a claim of a block whose store failed."""
        self._requests[request.request_id] = request
        self._maybe_raise("get_num_new_matched_tokens")
        hit = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        self._lookups[request.request_id] = (num_computed_tokens, bool(hit[1]))
        block_size = self._block_size()
        if hit[0] and block_size and self._failed_hashes:
            first = num_computed_tokens // block_size
            claimed = request.block_hashes[first:(num_computed_tokens + hit[0]) // block_size]
            bad = tuple(first + i for i, h in enumerate(claimed) if bytes(h) in self._failed_hashes)
            if bad:
                self.failed_store_hits.append(FailedStoreHit(request.request_id, self._step, bad))
        return hit

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Forward (or raise); draw whether a planned load fails."""
        self._requests[request.request_id] = request
        self._maybe_raise("update_state_after_alloc")
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0 and self._rng.random() < self.load_failure_rate:
            self.num_injected["loads"] += 1
            ids = list(blocks.get_block_ids()[0])
            local, is_async = self._lookups.get(request.request_id, (0, False))
            block_size = self._block_size()
            if block_size:  # only the blocks the load writes; else all (a superset is safe)
                ids = ids[local // block_size: -(-(local + num_external_tokens) // block_size)]
            self._step_failed[request.request_id] = (ids, is_async)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FaultMetadata:
        """Wrap the inner plan with this step's faults (or raise)."""
        fail_stores = self.store_failure_rate > 0 and self._rng.random() < self.store_failure_rate
        step = self._step
        self._note_completed_blocks(scheduler_output, step, failed=fail_stores)
        try:
            self._maybe_raise("build_connector_meta")
            inner = self.inner.build_connector_meta(scheduler_output)
        finally:
            self._step += 1
        meta = FaultMetadata(inner=msgspec.Raw(encode_metadata(inner)), failed_loads=self._step_failed,
                             fail_stores=fail_stores, step=step)
        self._step_failed = {}
        return meta

    def _note_completed_blocks(self, scheduler_output: SchedulerOutput, step: int, *, failed: bool) -> None:
        """Remember which block hashes this step's stores cover.

        A failed step's stores are taken to be the blocks it completes; a good step may
        store any full block of the requests it schedules (a connector may store blocks it
        could not store earlier, or a prefix it missed), so all of them count as stored.
        Erring this way a failed store can go unnoticed, but a good one is never reported.
        """
        block_size = self._block_size()
        if not block_size:
            return
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        completed: set[bytes] = set()
        for rid, done_before in computed.items():
            request = self._requests.get(rid)
            if request is None:
                continue
            done = done_before + scheduler_output.num_scheduled_tokens.get(rid, 0)
            first = done_before // block_size if failed else 0
            completed |= {bytes(h) for h in request.block_hashes[first:done // block_size]}
        self._completed[step] = set() if failed else completed - self._good_hashes
        self._completed.pop(step - _REMEMBERED_STEPS, None)
        self._mark(completed, failed=failed)

    def _mark(self, hashes: set[bytes], *, failed: bool) -> None:
        if failed:
            self._failed_hashes |= hashes - self._good_hashes
        else:
            self._good_hashes |= hashes
            self._failed_hashes -= hashes

    def check_failed_stores_invisible(self) -> None:
        """Assert that no lookup claimed a block whose store failed.

        Raises:
            AssertionError: naming the first such lookups.
        """
        if self.failed_store_hits:
            msg = (f"{self.inner.name}: {len(self.failed_store_hits)} lookups claimed blocks whose stores "
                   f"failed; first: {self.failed_store_hits[:3]}")
            raise AssertionError(msg)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forward (or raise)."""
        self._maybe_raise("update_connector_output")
        self.inner.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forward (or raise)."""
        self._lookups.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        self._maybe_raise("request_finished")
        return self.inner.request_finished(request, block_ids)

    def forget_requests(self, request_ids: set[str]) -> None:
        """Forward (or raise)."""
        self._maybe_raise("forget_requests")
        self.inner.forget_requests(request_ids)

    def plan_failed(self, connector_metadata: KVConnectorMetadata, *, loads_failed: bool,
                    stores_failed: bool) -> None:
        """Forward the inner plan (or raise); a plan whose stores failed makes them failed stores."""
        if not isinstance(connector_metadata, FaultMetadata):
            return
        if stores_failed:
            # The blocks that step stored first are failed stores after all (blocks stored
            # by an earlier step stay stored).
            hashes = self._completed.pop(connector_metadata.step, set())
            self._good_hashes -= hashes
            self._mark(hashes, failed=True)
        self._maybe_raise("plan_failed")
        inner = decode_metadata(connector_metadata.inner, self.inner.metadata_type)
        self.inner.plan_failed(inner, loads_failed=loads_failed, stores_failed=stores_failed)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Forward; a raise comes after draining the inner events, so they are lost."""
        events = list(self.inner.take_events())
        self._maybe_raise("take_events")
        return events

    def get_event_snapshot(self) -> Iterable[KVCacheEvent]:
        """Forward (or raise) the inner connector's event snapshot, where it has one."""
        self._maybe_raise("get_event_snapshot")
        snapshot = getattr(self.inner, "get_event_snapshot", None)
        return snapshot() if snapshot is not None else ()
