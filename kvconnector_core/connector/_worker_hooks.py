"""The worker-side hooks of :class:`~kvconnector_core.connector.base.KVConnectorBase_V1`.

A mixin of the base class, kept beside it so that each role's hooks read in one place;
connectors subclass :class:`~kvconnector_core.connector.base.KVConnectorBase_V1`, never this.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorTransferResults
from kvconnector_core.errors import InvariantError

if TYPE_CHECKING:  # the base must not import torch at import time
    import torch


class _WorkerHooks(abc.ABC):
    """The worker-side hooks (documented on the base class); see the module docstring."""

    _connector_metadata: KVConnectorMetadata | None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind this step's plan before the forward (worker side).

        Args:
            connector_metadata: what the scheduler side's ``build_connector_meta``
                returned for this step.
        """
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Unbind the plan after ``wait_for_save`` and the step's reports (worker side)."""
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        """Return True while a plan is bound."""
        return self._connector_metadata is not None

    def get_connector_metadata(self) -> KVConnectorMetadata:
        """Return this step's plan (worker side): what ``build_connector_meta`` returned.

        Raises:
            InvariantError: no plan is bound (called outside a step's
                ``bind_connector_metadata`` / ``clear_connector_metadata``).
        """
        return self._get_connector_metadata()

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        """Return the bound plan (vLLM's name; :meth:`get_connector_metadata` is the public one).

        Raises:
            InvariantError: no plan is bound (the hook was called outside
                ``bind_connector_metadata`` / ``clear_connector_metadata``).
        """
        if self._connector_metadata is None:
            msg = (
                f"{type(self).__name__}: no connector metadata is bound; worker hooks run "
                "only between bind_connector_metadata() and clear_connector_metadata()"
            )
            raise InvariantError(msg)
        return self._connector_metadata

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:  # noqa: B027 - optional hook
        """Act on the step's preemptions before the forward (worker side, optional).

        Called right after ``bind_connector_metadata`` and before
        ``start_load_kv`` and the forward, every step with a plan. A request
        preempted by the scheduler this step has already lost its GPU blocks,
        which this step's forward may overwrite; a connector that still reads
        them asynchronously (a pending save) must finish or submit those reads
        here. The plan should name the preempted requests (the scheduler side
        sees ``scheduler_output.preempted_req_ids``). Default: does nothing.

        Args:
            connector_metadata: the plan just bound (the same object).
        """

    def build_connector_worker_meta(self) -> Any:
        """Return records for this connector's scheduler side (worker side, optional).

        Called once per step after ``get_kv_connector_stats``; the result
        travels as ``KVConnectorOutput.kv_connector_worker_meta`` to the
        scheduler side's ``update_connector_output``. Use it for things the
        scheduler side must act on (e.g. ids of finished transfer jobs), not
        the stats, which wrappers aggregate and engines report. Prefer a
        msgspec Struct. With several workers (tensor parallelism inside vLLM)
        the records of one step are folded with the record's
        ``aggregate(other)`` method, so give it one; ``config.world_size`` says
        how many workers report. Default: None (nothing to report).
        """
        return None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:  # noqa: B027 - optional hook
        """Receive the paged KV tensors once they are allocated (worker side).

        Args:
            kv_caches: layer name -> that layer's KV tensor, in layer order.
                Default: ignored.
        """

    @abc.abstractmethod
    def start_load_kv(self, forward_context: Any = None) -> None:
        """Start loading this step's planned KV into the GPU blocks (worker side).

        Called every step. With synchronous loads (``has_sync_kv_loads``) it
        runs before the forward and the loads must be complete before a layer
        reads them (in ``wait_for_layer_load`` at the latest); otherwise it
        runs right after the forward is launched.

        Args:
            forward_context: engine-specific context of the forward, or None.
        """

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV for this step is loaded (worker side).

        Called inside each attention layer before it reads the KV cache.
        """

    @abc.abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        """Start saving one layer's KV (worker side).

        Called inside each attention layer after it wrote its KV.

        Args:
            layer_name: the layer.
            kv_layer: that layer's paged KV tensor.
            attn_metadata: engine-specific attention metadata, or None.
        """

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """End of the step's saves (worker side).

        Called once per step, empty steps included, with the plan still bound.
        A connector saving asynchronously may return at once, but must keep
        reading from the source blocks only until it reports the request in
        ``get_finished``'s sending set.
        """

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report requests whose asynchronous transfers completed (worker side).

        Args:
            finished_req_ids: requests the scheduler finished in this step's
                schedule; every id later reported as sending must have appeared
                here in this or an earlier step.

        Returns:
            ``(finished_sending, finished_recving)``; either may be None (=
            empty). Each request is reported at most once per direction.
            Default: ``(None, None)``.
        """
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Report finished and failed transfers (worker side); the model runner calls this.

        The default wraps :meth:`get_finished` and reports no failed receive.
        Override it (instead of ``get_finished``) to report
        ``failed_recving``: a request whose asynchronous load failed appears in
        both ``finished_recving`` and ``failed_recving``, and its blocks in
        ``get_block_ids_with_load_errors``. Call one of the two per step, not
        both: each transfer is reported once.

        Args:
            finished_req_ids: as for :meth:`get_finished`.

        Returns:
            The step's transfer results.
        """
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ())
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Return GPU block ids whose load failed since the last call (worker side).

        Synchronous loads report in the step the error is detected;
        asynchronous loads no later than the step their request appears in
        ``finished_recving``. Default: empty set.
        """
        return set()
