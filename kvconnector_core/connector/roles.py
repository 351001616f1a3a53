"""Role objects: a connector as a scheduler-side object and a worker-side object.

:class:`~kvconnector_core.connector.base.KVConnectorBase_V1` stays the public,
vLLM-shaped facade; a single class implementing its hooks works as before. A connector
whose two roles share nothing but the plan and the worker's report can instead be
written as two small objects, each implementing one interface:

- :class:`KVConnectorSchedulerSide`: plans loads and stores, learns completions;
- :class:`KVConnectorWorkerSide`: moves the bytes for the plan bound each step;

and tied together by a :class:`RoleSplitConnector` facade, which creates the object of
its role and forwards every hook to it (the way vLLM's OffloadingConnector delegates to
its scheduler and worker halves, or httpx pairs ``BaseTransport`` /
``AsyncBaseTransport``). A hook of the other role raises :class:`InvariantError` naming
both roles, instead of an ``AttributeError`` from state that only the other role has.

Primitives: :class:`KVConnectorSchedulerSide`, :class:`KVConnectorWorkerSide`,
:class:`RoleSplitConnector`.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvconnector_core.connector.base import KVConnectorBase_V1, KVConnectorRole
from kvconnector_core.connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorTransferResults,
)
from kvconnector_core.errors import InvariantError

if TYPE_CHECKING:
    import torch

    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["KVConnectorSchedulerSide", "KVConnectorWorkerSide", "RoleSplitConnector"]


class KVConnectorSchedulerSide(abc.ABC):
    """The scheduler-side half of a connector; hooks mean what they mean on the facade.

    Three hooks are abstract; the others default to doing nothing.
    """

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens loadable beyond the local hit and whether asynchronously (None = ask again)."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Learn an admitted request's blocks and how many tokens this connector loads."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's plan for the worker side."""

    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:  # noqa: B027 - optional hook
        """Receive the GPU block pool. Default: ignored."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:  # noqa: B027
        """Learn what the worker side finished. Default: ignored."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)``. Default: ``(False, None)``."""
        return False, None

    def forget_requests(self, request_ids: set[str]) -> None:  # noqa: B027 - optional hook
        """Plan nothing more for these requests (see the facade). Default: nothing."""

    def plan_failed(self, connector_metadata: KVConnectorMetadata, *, loads_failed: bool,  # noqa: B027
                    stores_failed: bool) -> None:
        """Part of a plan failed on the worker side (see the facade). Default: nothing."""

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV cache events since the last call. Default: none."""
        return ()

    def get_event_snapshot(self) -> Iterable[KVCacheEvent]:
        """Per medium a clear and every block held now (a resync). Default: none."""
        return ()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Scheduler-side statistics (deltas since the last call, gauges apart). Default: None."""
        return None

    def has_pending_work(self) -> bool:
        """Something to deliver in a later step (see the facade). Default: False."""
        return False

    def reset_cache(self) -> bool | None:
        """Drop cached KV and release held GPU blocks before a prefix-cache reset. Default: None."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Default: nothing."""


class KVConnectorWorkerSide(abc.ABC):
    """The worker-side half of a connector; hooks mean what they mean on the facade.

    The plan of the step is passed to :meth:`bind_connector_metadata` and kept in
    :attr:`plan` until :meth:`clear_connector_metadata`.
    """

    plan: KVConnectorMetadata | None = None
    """The plan bound for the current step, or None between steps."""

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's plan (default: keep it in :attr:`plan`)."""
        self.plan = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Unbind the plan at the end of the step."""
        self.plan = None

    @abc.abstractmethod
    def start_load_kv(self, forward_context: Any = None) -> None:
        """Start the step's loads."""

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until one layer's loads are done."""

    @abc.abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        """Start saving one layer."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """End of the step's saves."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:  # noqa: B027
        """Receive the paged KV tensors. Default: ignored."""

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:  # noqa: B027
        """Act on the step's preemptions before the forward. Default: nothing."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished and failed transfers. Default: none."""
        return KVConnectorTransferResults()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks whose load failed since the last call. Default: none."""
        return set()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The step's statistics. Default: None."""
        return None

    def has_pending_work(self) -> bool:
        """Something to deliver in a later step (see the facade). Default: False."""
        return False

    def build_connector_worker_meta(self) -> Any:
        """Records for the scheduler side. Default: None."""
        return None

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Default: nothing."""


class RoleSplitConnector(KVConnectorBase_V1):
    """A facade that creates the role object of its role and forwards every hook to it.

    Subclasses implement :meth:`make_scheduler_side` and :meth:`make_worker_side`
    (called once, for the instance's role, at the end of ``__init__``).
    """

    def __init__(self, config: KVConnectorConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(config, role, kv_cache_config)
        self._scheduler_side: KVConnectorSchedulerSide | None = None
        self._worker_side: KVConnectorWorkerSide | None = None
        if self._role == KVConnectorRole.SCHEDULER:
            self._scheduler_side = self.make_scheduler_side()
        else:
            self._worker_side = self.make_worker_side()

    @abc.abstractmethod
    def make_scheduler_side(self) -> KVConnectorSchedulerSide:
        """Create the scheduler-side object (the instance's config is set)."""

    @abc.abstractmethod
    def make_worker_side(self) -> KVConnectorWorkerSide:
        """Create the worker-side object (the instance's config is set)."""

    def _wrong_role(self, wanted: KVConnectorRole) -> InvariantError:
        return InvariantError(f"{type(self).__name__}: a {wanted.name.lower()}-side hook was called "
                              f"on the {self._role.name.lower()}-side instance")

    @property
    def scheduler_side(self) -> KVConnectorSchedulerSide:
        """The scheduler-side object.

        Raises:
            InvariantError: this is the worker-side instance.
        """
        if self._scheduler_side is None:
            raise self._wrong_role(KVConnectorRole.SCHEDULER)
        return self._scheduler_side

    @property
    def worker_side(self) -> KVConnectorWorkerSide:
        """The worker-side object.

        Raises:
            InvariantError: this is the scheduler-side instance.
        """
        if self._worker_side is None:
            raise self._wrong_role(KVConnectorRole.WORKER)
        return self._worker_side

    # ----------------------------------------------------------- scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:
        """Forwarded to the scheduler side."""
        self.scheduler_side.bind_gpu_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Forwarded to the scheduler side."""
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Forwarded to the scheduler side."""
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Forwarded to the scheduler side."""
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forwarded to the scheduler side."""
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forwarded to the scheduler side."""
        return self.scheduler_side.request_finished(request, block_ids)

    def forget_requests(self, request_ids: set[str]) -> None:
        """Forwarded to the scheduler side."""
        self.scheduler_side.forget_requests(request_ids)

    def plan_failed(self, connector_metadata: KVConnectorMetadata, *, loads_failed: bool,
                    stores_failed: bool) -> None:
        """Forwarded to the scheduler side."""
        self.scheduler_side.plan_failed(connector_metadata, loads_failed=loads_failed,
                                        stores_failed=stores_failed)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Forwarded to the scheduler side."""
        return self.scheduler_side.take_events()

    def reset_cache(self) -> bool | None:
        """Forwarded to the scheduler side."""
        return self.scheduler_side.reset_cache()

    def get_event_snapshot(self) -> Iterable[KVCacheEvent]:
        """Forwarded to the scheduler side."""
        return self.scheduler_side.get_event_snapshot()

    # -------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Forwarded to the worker side."""
        self.worker_side.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bound here (``has_connector_metadata``) and forwarded to the worker side."""
        self.worker_side.bind_connector_metadata(connector_metadata)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        """Forwarded to the worker side, then unbound here."""
        self.worker_side.clear_connector_metadata()
        super().clear_connector_metadata()

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:
        """Forwarded to the worker side."""
        self.worker_side.handle_preemptions(connector_metadata)

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Forwarded to the worker side."""
        self.worker_side.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Forwarded to the worker side."""
        self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        """Forwarded to the worker side."""
        self.worker_side.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        """Forwarded to the worker side."""
        self.worker_side.wait_for_save()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Forwarded to the worker side."""
        return self.worker_side.get_transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Legacy form of :meth:`get_transfer_results` (failed receives count as finished)."""
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Forwarded to the worker side."""
        return self.worker_side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Any:
        """Forwarded to the worker side."""
        return self.worker_side.build_connector_worker_meta()

    # ---------------------------------------------------------------- both roles

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """Forwarded to the object of this instance's role."""
        side = self._scheduler_side or self._worker_side
        assert side is not None  # noqa: S101 - one of the two is always set
        return side.get_kv_connector_stats()

    def has_pending_work(self) -> bool:
        """Forwarded to the object of this instance's role."""
        side = self._scheduler_side or self._worker_side
        return bool(getattr(side, "has_pending_work", lambda: False)())

    def shutdown(self) -> None:
        """Forwarded to the object of this instance's role."""
        side = self._scheduler_side or self._worker_side
        assert side is not None  # noqa: S101 - one of the two is always set
        side.shutdown()
