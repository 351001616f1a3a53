"""Fault injection: wrap a connector so that loads fail, stores fail, or hooks raise.

:class:`FaultInjectingConnector` wraps one side of a connector (build one
wrapper per side with the same arguments). Faults are drawn from
``random.Random(seed)``, so a test is reproducible:

- **Load failures** (``load_failure_rate``): the scheduler-side wrapper decides,
  per load the inner connector plans (``update_state_after_alloc`` with
  external tokens), whether it fails, and tells the worker-side wrapper in its
  metadata. The worker-side wrapper then reports the load's blocks in
  ``get_block_ids_with_load_errors`` and, for an asynchronous load, the request
  as a failed receive (in ``finished_recving`` and ``failed_recving``), exactly
  as a connector whose transfer failed must. The inner connector still runs,
  so its data is ignored, never trusted.
- **Store failures** (``store_failure_rate``): per step, the scheduler-side
  wrapper decides whether the step's stores fail; the worker-side wrapper then
  does not forward ``save_kv_layer`` / ``wait_for_save`` to the inner
  connector and raises :class:`InjectedFault` from ``wait_for_save``, which is
  how a store failure surfaces to the engine. Use it to check that the engine
  (or a MultiConnector) contains a failing save.
- **Raising hooks** (``raise_in``): the named hooks raise :class:`InjectedFault`
  instead of reaching the inner connector.

Primitives: :class:`FaultInjectingConnector`, :class:`FaultMetadata`,
:class:`InjectedFault`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from kvconnector_core.connector.base import ABSTRACT_HOOKS, OPTIONAL_HOOKS, KVConnectorBase_V1
from kvconnector_core.connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorTransferResults,
    decode_metadata,
    encode_metadata,
)
from kvconnector_core.errors import ConfigError, TransferError

if TYPE_CHECKING:
    import torch

    from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["FAULT_HOOKS", "FaultInjectingConnector", "FaultMetadata", "InjectedFault"]

FAULT_HOOKS: frozenset[str] = frozenset(
    (*ABSTRACT_HOOKS, *OPTIONAL_HOOKS, "bind_connector_metadata", "clear_connector_metadata")
)
"""Hook names ``raise_in`` accepts."""


class InjectedFault(TransferError):
    """Raised by a :class:`FaultInjectingConnector` hook on purpose."""


class FaultMetadata(KVConnectorMetadata, kw_only=True):
    """The wrapper's plan: the inner plan plus the faults drawn for this step.

    Attributes:
        inner: the inner connector's metadata, msgpack-encoded.
        failed_loads: request id -> (block ids, is_async) of loads that fail.
        fail_stores: whether this step's stores fail.
    """

    inner: msgspec.Raw
    failed_loads: dict[str, tuple[list[int], bool]] = msgspec.field(default_factory=dict)
    fail_stores: bool = False


class FaultInjectingConnector(KVConnectorBase_V1):
    """Wraps a connector and injects faults; see the module docstring."""

    name: ClassVar[str] = "FaultInjectingConnector"
    metadata_type: ClassVar[type[KVConnectorMetadata]] = FaultMetadata

    def __init__(
        self,
        inner: KVConnectorBase_V1,
        *,
        load_failure_rate: float = 0.0,
        store_failure_rate: float = 0.0,
        raise_in: Iterable[str] = (),
        seed: int = 0,
    ) -> None:
        """Wrap ``inner``.

        Args:
            inner: the connector (one side) to wrap.
            load_failure_rate: probability that a planned load fails, in [0, 1].
            store_failure_rate: probability that a step's stores fail, in [0, 1].
            raise_in: hook names that raise :class:`InjectedFault`.
            seed: seed of the fault RNG.

        Raises:
            ConfigError: a rate outside [0, 1] or an unknown hook name.
        """
        super().__init__(inner.config, inner.role, inner.kv_cache_config)
        for label, rate in (("load_failure_rate", load_failure_rate), ("store_failure_rate", store_failure_rate)):
            if not 0.0 <= rate <= 1.0:
                msg = f"FaultInjectingConnector {label}={rate!r}; must be within [0, 1]"
                raise ConfigError(msg)
        unknown = set(raise_in) - FAULT_HOOKS
        if unknown:
            msg = f"FaultInjectingConnector raise_in has unknown hooks {sorted(unknown)}; valid: {sorted(FAULT_HOOKS)}"
            raise ConfigError(msg)
        self.inner = inner
        self.load_failure_rate = load_failure_rate
        self.store_failure_rate = store_failure_rate
        self.raise_in = frozenset(raise_in)
        self._rng = random.Random(seed)
        self.supports_async_load = inner.supports_async_load  # type: ignore[misc]
        self.has_sync_kv_loads = inner.has_sync_kv_loads  # type: ignore[misc]
        self.requires_block_pool = inner.requires_block_pool  # type: ignore[misc]
        self._lookups: dict[str, tuple[int, bool]] = {}  # req -> (local hit, async)
        self._step_failed: dict[str, tuple[list[int], bool]] = {}
        self._invalid: set[int] = set()
        self._failed_recv: set[str] = set()
        self._suppressed_recv: set[str] = set()
        self._fail_stores = False
        self.num_injected = {"loads": 0, "stores": 0, "raises": 0}
        """How many faults were injected, by kind."""

    def __repr__(self) -> str:
        return f"<FaultInjectingConnector inner={self.inner!r}>"

    def _maybe_raise(self, hook: str) -> None:
        if hook in self.raise_in:
            self.num_injected["raises"] += 1
            msg = f"injected fault in {self.inner.name}.{hook}"
            raise InjectedFault(msg)

    # scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:
        """Forward (or raise)."""
        self._maybe_raise("bind_gpu_block_pool")
        self.inner.bind_gpu_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Forward (or raise); remember the local hit to locate a failed load's blocks."""
        self._maybe_raise("get_num_new_matched_tokens")
        hit = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        self._lookups[request.request_id] = (num_computed_tokens, bool(hit[1]))
        return hit

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Forward (or raise); draw whether a planned load fails."""
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

    def _block_size(self) -> int | None:
        try:
            return int(self._kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)  # type: ignore[union-attr]
        except (AttributeError, IndexError, TypeError):
            return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FaultMetadata:
        """Wrap the inner plan with this step's faults."""
        self._maybe_raise("build_connector_meta")
        inner = self.inner.build_connector_meta(scheduler_output)
        fail_stores = self.store_failure_rate > 0 and self._rng.random() < self.store_failure_rate
        meta = FaultMetadata(inner=msgspec.Raw(encode_metadata(inner)), failed_loads=self._step_failed,
                             fail_stores=fail_stores)
        self._step_failed = {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forward (or raise)."""
        self._maybe_raise("update_connector_output")
        self.inner.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forward (or raise)."""
        self._maybe_raise("request_finished")
        self._lookups.pop(request.request_id, None)
        return self.inner.request_finished(request, block_ids)

    def forget_requests(self, request_ids: set[str]) -> None:
        """Forward (or raise)."""
        self._maybe_raise("forget_requests")
        self.inner.forget_requests(request_ids)

    def plan_failed(self, connector_metadata: KVConnectorMetadata, *, loads_failed: bool,
                    stores_failed: bool) -> None:
        """Forward the inner plan (or raise)."""
        self._maybe_raise("plan_failed")
        if isinstance(connector_metadata, FaultMetadata):
            inner = decode_metadata(connector_metadata.inner, self.inner.metadata_type)
            self.inner.plan_failed(inner, loads_failed=loads_failed, stores_failed=stores_failed)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Forward (or raise)."""
        self._maybe_raise("take_events")
        return self.inner.take_events()

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Forward (or raise)."""
        self._maybe_raise("register_kv_caches")
        self.inner.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the inner plan; note the step's faults."""
        self._maybe_raise("bind_connector_metadata")
        if not isinstance(connector_metadata, FaultMetadata):
            msg = f"FaultInjectingConnector expected FaultMetadata, got {type(connector_metadata).__qualname__}"
            raise ConfigError(msg)
        super().bind_connector_metadata(connector_metadata)
        self.inner.bind_connector_metadata(decode_metadata(connector_metadata.inner, self.inner.metadata_type))
        for req_id, (ids, is_async) in connector_metadata.failed_loads.items():
            self._invalid.update(ids)
            if is_async:
                self._failed_recv.add(req_id)
                self._suppressed_recv.add(req_id)
        self._fail_stores = connector_metadata.fail_stores
        if self._fail_stores:
            self.num_injected["stores"] += 1

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Forward (or raise)."""
        self._maybe_raise("start_load_kv")
        self.inner.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Forward (or raise)."""
        self._maybe_raise("wait_for_layer_load")
        self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        """Forward (or raise)."""
        self._maybe_raise("save_kv_layer")
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        """Forward; when this step's stores fail, raise InjectedFault afterwards.

        The inner connector still runs its bookkeeping (queued jobs, delayed frees):
        skipping it would leave requests it holds blocks for unreleased forever. So an
        injected store failure tests that the engine contains a raising save hook; it
        cannot make an arbitrary connector forget a store it already made.
        """
        self._maybe_raise("wait_for_save")
        self.inner.wait_for_save()
        if self._fail_stores:
            msg = f"injected store failure in {self.inner.name} this step"
            raise InjectedFault(msg)

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:
        """Forward the inner plan (or raise), so preempted requests' stores are flushed."""
        self._maybe_raise("handle_preemptions")
        if isinstance(connector_metadata, FaultMetadata):
            self.inner.handle_preemptions(decode_metadata(connector_metadata.inner, self.inner.metadata_type))

    def build_connector_worker_meta(self) -> Any:
        """Forward (or raise): the inner connector's job completions travel here."""
        self._maybe_raise("build_connector_worker_meta")
        return self.inner.build_connector_worker_meta()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The inner results, with failed loads reported as failed receives."""
        self._maybe_raise("get_transfer_results")
        res = self.inner.get_transfer_results(finished_req_ids)
        recving = {r for r in res.finished_recving if r not in self._suppressed_recv}
        self._suppressed_recv -= res.finished_recving
        out = KVConnectorTransferResults(
            finished_sending=set(res.finished_sending),
            finished_recving=recving | self._failed_recv,
            failed_recving=(set(res.failed_recving) & recving) | self._failed_recv,
        )
        self._failed_recv = set()
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Legacy form of :meth:`get_transfer_results`."""
        self._maybe_raise("get_finished")
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The inner errors plus the injected failed loads' blocks."""
        self._maybe_raise("get_block_ids_with_load_errors")
        errors, self._invalid = self._invalid | set(self.inner.get_block_ids_with_load_errors()), set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The inner stats plus ``injected_faults``."""
        self._maybe_raise("get_kv_connector_stats")
        stats = dict(self.inner.get_kv_connector_stats() or {})
        stats["injected_faults"] = dict(self.num_injected)
        return stats

    def clear_connector_metadata(self) -> None:
        """Unbind both plans."""
        self._maybe_raise("clear_connector_metadata")
        self.inner.clear_connector_metadata()
        self._fail_stores = False
        super().clear_connector_metadata()

    def shutdown(self) -> None:
        """Forward (or raise)."""
        self._maybe_raise("shutdown")
        self.inner.shutdown()
