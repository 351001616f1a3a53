"""A scriptable connector that records every hook call (a test double).

:class:`RecordingConnector` moves no bytes. It answers lookups with a scripted
hit, delays frees when told to, reports completions the way a real
asynchronous connector would (through its metadata, so both sides stay
consistent), and appends every hook call to ``calls``. Use it to check hook
order, MultiConnector composition, and scheduler bookkeeping.

extra_config keys: ``hit_tokens`` (int or None; default 0), ``load_async``
(bool), ``delay_free`` (bool), ``params`` (dict returned by ``request_finished``),
``stats`` (dict returned by ``get_kv_connector_stats``).

Primitives: :class:`RecordingConnector`, :class:`RecordingMetadata`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from kvconnector_core.connector.base import KVConnectorBase_V1, KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorOutput

if TYPE_CHECKING:
    from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["RecordingConnector", "RecordingMetadata"]


class RecordingMetadata(KVConnectorMetadata, kw_only=True):
    """RecordingConnector's plan.

    Attributes:
        step: scheduler step counter.
        loads: request id -> block ids planned to load this step.
        async_loads: requests whose (asynchronous) load completes this step.
        delayed_sends: requests whose delayed free completes once finished.
    """

    step: int = 0
    loads: dict[str, list[int]] = msgspec.field(default_factory=dict)
    async_loads: list[str] = msgspec.field(default_factory=list)
    delayed_sends: list[str] = msgspec.field(default_factory=list)


class RecordingConnector(KVConnectorBase_V1):
    """Records hook calls in ``calls`` as ``(hook, args)``; see the module docstring."""

    name: ClassVar[str] = "RecordingConnector"
    metadata_type: ClassVar[type[KVConnectorMetadata]] = RecordingMetadata
    supports_async_load: ClassVar[bool] = True
    has_sync_kv_loads: ClassVar[bool] = True
    supports_multiple_kv_cache_groups: ClassVar[bool] = True  # it moves no KV data

    def __init__(self, config: KVConnectorConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        """Create the connector (see :class:`KVConnectorBase_V1`)."""
        super().__init__(config, role, kv_cache_config)
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.block_pool: GPUBlockPoolView | None = None
        self._step = 0
        self._loads: dict[str, list[int]] = {}
        self._async: list[str] = []
        self._delayed: list[str] = []
        self._worker_pending_sends: set[str] = set()
        self.is_shut_down = False

    def _record(self, hook: str, *args: Any) -> None:
        self.calls.append((hook, args))

    def hooks_called(self) -> list[str]:
        """Return the names of the hooks called so far, in order."""
        return [hook for hook, _ in self.calls]

    # scheduler side
    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:
        """Keep the pool in ``block_pool``."""
        self._record("bind_gpu_block_pool", gpu_block_pool)
        self.block_pool = gpu_block_pool

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Return the scripted ``hit_tokens`` (and ``load_async`` when it is positive)."""
        self._record("get_num_new_matched_tokens", request.request_id, num_computed_tokens)
        hit = self._config.extra_config.get("hit_tokens", 0)
        if hit is None:
            return None, False
        return hit, bool(hit) and bool(self._config.extra_config.get("load_async", False))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Plan a load of the request's blocks when ``num_external_tokens > 0``."""
        self._record("update_state_after_alloc", request.request_id, blocks.get_block_ids(),
                     num_external_tokens)
        if num_external_tokens > 0:
            self._loads[request.request_id] = list(blocks.get_block_ids()[0])
            if self._config.extra_config.get("load_async", False):
                self._async.append(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> RecordingMetadata:
        """Return this step's plan and reset per-step state."""
        self._record("build_connector_meta", scheduler_output)
        self._step += 1
        meta = RecordingMetadata(step=self._step, loads=self._loads, async_loads=self._async,
                                 delayed_sends=self._delayed)
        self._loads, self._async, self._delayed = {}, [], []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Record the output."""
        self._record("update_connector_output", connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay the free when ``delay_free`` is set; return the scripted ``params``."""
        self._record("request_finished", request.request_id, list(block_ids))
        delay = bool(self._config.extra_config.get("delay_free", False))
        if delay:
            self._delayed.append(request.request_id)
        return delay, self._config.extra_config.get("params")

    def take_events(self) -> list[Any]:
        """No events; recorded."""
        self._record("take_events")
        return []

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Record the layer names."""
        self._record("register_kv_caches", tuple(kv_caches))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind and record."""
        self._record("bind_connector_metadata", connector_metadata)
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Record (checks that a plan is bound)."""
        self._get_connector_metadata()
        self._record("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Record."""
        self._record("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any = None) -> None:
        """Record."""
        self._record("save_kv_layer", layer_name)

    def wait_for_save(self) -> None:
        """Record (checks that a plan is bound)."""
        meta = self._get_connector_metadata()
        if isinstance(meta, RecordingMetadata):
            self._worker_pending_sends.update(meta.delayed_sends)
        self._record("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report delayed sends once finished, and async loads in the step they were planned."""
        self._record("get_finished", set(finished_req_ids))
        meta = self._connector_metadata
        sending = self._worker_pending_sends & set(finished_req_ids)
        self._worker_pending_sends -= sending
        recving = set(meta.async_loads) if isinstance(meta, RecordingMetadata) else set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Record; no errors."""
        self._record("get_block_ids_with_load_errors")
        return set()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Return the scripted ``stats``."""
        self._record("get_kv_connector_stats")
        return self._config.extra_config.get("stats")

    def clear_connector_metadata(self) -> None:
        """Unbind and record."""
        self._record("clear_connector_metadata")
        super().clear_connector_metadata()

    def shutdown(self) -> None:
        """Record; idempotent."""
        self._record("shutdown")
        self.is_shut_down = True
