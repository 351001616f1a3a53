"""The adapter's worker-role object: vLLM's per-step model-runner hooks, through the guard.

:class:`AdapterWorker` forwards the hooks of a step (registration, bind, preemptions,
loads, saves, results, load errors, events, worker metadata, clear) to the wrapped
connector through its :class:`~kvconnector_core.connector.guard.GuardedWorker`, and
reports the loads the scheduler role already knows failed (carried in
:class:`~.records.AdapterMetadata`) as failed receives, so that vLLM never waits for
them. The connector's synchronous loads reach vLLM as receives (see
:mod:`~kvconnector_core.integrations.vllm.scheduler`): the worker completes them in
``start_load_kv`` and reports them finished in the same step.

Primitives: :class:`AdapterWorker`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults as VllmTransferResults,
)

from kvconnector_core.connector.guard import GuardedWorker
from kvconnector_core.integrations.vllm.layouts import block_dense_views
from kvconnector_core.integrations.vllm.records import (
    AdapterKVEvents,
    AdapterMetadata,
    AdapterWorkerMetadata,
    to_vllm_events,
)

if TYPE_CHECKING:
    import torch

    from kvconnector_core.connector.base import KVConnectorBase_V1

__all__ = ["AdapterWorker"]

_MAX_REPORTED_RECVING = 100_000
"""Request ids remembered to drop a second report of a receive: a load the adapter
reported (failed, or synchronous) that the connector also reports later (vLLM asserts on
it)."""


def _remember(seen: OrderedDict[str, None], ids: set[str]) -> None:
    """Add ``ids`` to a bounded record of reported request ids (oldest dropped)."""
    for rid in ids:
        seen[rid] = None
    while len(seen) > _MAX_REPORTED_RECVING:
        seen.popitem(last=False)


class AdapterWorker:
    """The worker-role instance's hooks and state (the adapter forwards vLLM's calls here).

    Args:
        connector: the wrapped connector (worker-role instance).
        several_groups: the model has several KV cache groups (vLLM's HMA).

    Attributes:
        guard: the wrapped connector behind kvconnector's failure contract.
    """

    def __init__(self, connector: KVConnectorBase_V1, *, several_groups: bool) -> None:
        self.guard = GuardedWorker(connector)
        self._several_groups = several_groups
        self._meta: Any = None  # the plan bound for this step (vLLM's record)
        self._step_begun = False
        self._step_invalid: set[int] = set()
        self._layer_names: list[str] = []  # vLLM's attention layers (register_kv_caches)
        # HMA: the asynchronous loads in flight and the blocks each writes, and those a
        # load error already hit (reported failed when their receive finishes)
        self._recving_blocks: dict[str, set[int]] = {}
        self._poisoned_recving: set[str] = set()
        # Receives the adapter reported for the connector (failed ones, and synchronous
        # loads): a later report of the same request by the connector is dropped (vLLM
        # asserts on a report for a request it has forgotten or already runs). Bounded,
        # oldest dropped.
        self._reported_for_connector: OrderedDict[str, None] = OrderedDict()
        # Sends reported, until the scheduler side's plans stop listing them as unreported
        # (vLLM then dropped the request; a later request may reuse its id).
        self._reported_sent: set[str] = set()

    # ------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Hand vLLM's per-layer tensors over as block-dense views (no copies; see
        :mod:`~kvconnector_core.integrations.vllm.layouts`)."""
        self._layer_names = list(kv_caches)
        views: dict[str, torch.Tensor] = {}
        for name, tensor in kv_caches.items():
            views.update(block_dense_views(name, tensor))
        self.guard.register_kv_caches(views)

    # ------------------------------------------------------------ step start and end

    def _begin_step(self) -> None:
        # vLLM computes nothing on a load in the step that runs it (every load is a
        # receive to vLLM), so the guard treats each step's loads as asynchronous.
        if not self._step_begun:
            self._step_begun = True
            self.guard.begin_step(sync_loads=False)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Bind the wrapped plan (none when the scheduler side failed to build one)."""
        self._meta = connector_metadata
        self._begin_step()
        if connector_metadata.inner is not None:
            self.guard.bind_connector_metadata(connector_metadata.inner)

    def clear_connector_metadata(self) -> None:
        """Unbind; the next hook starts the guard's next step."""
        self._meta = None
        self.guard.clear_connector_metadata()
        self._step_begun = False

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Forwarded with the wrapped plan (vLLM calls it before the bind)."""
        self._begin_step()
        if kv_connector_metadata.inner is not None:
            self.guard.handle_preemptions(kv_connector_metadata.inner)

    # ------------------------------------------------------------ loads and saves

    def start_load_kv(self, forward_context: Any) -> None:
        """Forwarded; with synchronous loads planned, every layer is then waited for.

        vLLM waits for each layer during the forward, before it starts a step without
        synchronous loads (to vLLM there are none), and not at all in a step without a
        forward; a connector that loads layer by layer in ``wait_for_layer_load`` must
        still finish the loads this step reports received.
        """
        self.guard.start_load_kv(forward_context)
        meta = self._meta
        if isinstance(meta, AdapterMetadata) and meta.sync_recving:
            for name in self._layer_names:
                self.guard.wait_for_layer_load(name)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Forwarded."""
        self.guard.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Forwarded."""
        self.guard.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        """Forwarded."""
        self.guard.wait_for_save()

    # ------------------------------------------------------------ the step's report

    def get_transfer_results(self, finished_req_ids: set[str]) -> VllmTransferResults:
        """The wrapped results in vLLM's record, plus the receives the plan says failed.

        The load errors are read here too (kvconnector's order: results, then errors):
        vLLM takes ``failed_recving`` from this call, and when the errors hook raised
        every receive of the step must count as failed. With several KV cache groups
        (HMA), load errors by block fail the step's receives instead (vLLM refuses
        them by block).
        """
        guard, meta = self.guard, self._meta
        # No plan bound: an empty one, which adds nothing to the report.
        plan = meta if isinstance(meta, AdapterMetadata) else AdapterMetadata()
        # vLLM takes a request id again once the request with it is gone: a new load
        # under a remembered id is another request's, and its report must pass.
        for rid in plan.async_loads | plan.sync_recving:
            self._reported_for_connector.pop(rid, None)
        res = guard.get_transfer_results(set(finished_req_ids))
        self._step_invalid = set(guard.get_block_ids_with_load_errors())
        failed = set(res.finished_recving if guard.load_errors_unknown else res.failed_recving)
        recving = {r for r in res.finished_recving if r not in self._reported_for_connector}
        recving |= plan.failed_recving | plan.sync_recving
        failed |= plan.failed_recving
        if guard.loads_failed:  # the step's synchronous loads did not all run
            failed |= plan.sync_recving
        _remember(self._reported_for_connector, plan.failed_recving | plan.sync_recving)
        if self._several_groups:
            failed |= self._hma_failed_receives(meta, recving)
        sending = set(res.finished_sending)
        if guard.stores_failed and plan.delayed_frees:
            sending |= self._frees_it_may_never_learn(plan.delayed_frees)
        sending = self._first_reports_of_sends(sending, meta)
        return VllmTransferResults(finished_sending=sending, finished_recving=recving,
                                   failed_recving=failed & recving)

    def _hma_failed_receives(self, meta: Any, recving: set[str]) -> set[str]:
        """With several KV cache groups: the receives of ``recving`` that a load error hit.

        vLLM 0.33 raises on any load error reported by block id when the model has
        several KV cache groups (``Scheduler._handle_invalid_blocks``); a failed receive
        is the only report it takes. Every load is asynchronous there (the scheduler
        side presents synchronous ones as receives), and the plan names each load's blocks, so an
        error is charged to the receives holding its blocks, whether it comes in the
        step their receive finishes or earlier. A block no receive in flight holds
        fails them all (costs hits, never data).
        """
        if isinstance(meta, AdapterMetadata):
            self._recving_blocks.update(meta.load_blocks)
        invalid, self._step_invalid = self._step_invalid, set()
        if invalid:
            hit = {rid for rid, blocks in self._recving_blocks.items() if blocks & invalid}
            known = set().union(*self._recving_blocks.values()) if self._recving_blocks else set()
            everyone = set(self._recving_blocks) | recving
            self._poisoned_recving |= hit if invalid <= known else everyone
        failed = recving & self._poisoned_recving
        for rid in recving:
            self._recving_blocks.pop(rid, None)
            self._poisoned_recving.discard(rid)
        return failed

    def _first_reports_of_sends(self, sending: set[str], meta: Any) -> set[str]:
        """The sends of ``sending`` to report to vLLM: each once per request.

        A send may be reported twice (the worker's own report after failed stores, then
        the connector's), and vLLM asserts on a report for a request it already
        dropped. Only requests the plan lists as unreported sends are reported; an id is
        remembered until the plans stop listing it, which happens only after vLLM has
        processed its report and dropped the request, so a later request with the same
        id is reported again. vLLM 0.33 allows that reuse: ``Scheduler.add_request``
        checks only live requests (``v1/core/sched/scheduler.py``), and the front end's
        random suffix on client ids (``InputProcessor.assign_request_id``) is off with
        ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` and absent for requests sent to the
        engine core directly.
        """
        if not isinstance(meta, AdapterMetadata):  # no plan bound: no list to check against
            sending -= self._reported_sent
        else:
            self._reported_sent &= meta.unreported_sends
            sending = (sending & meta.unreported_sends) - self._reported_sent
        self._reported_sent |= sending
        return sending

    def _frees_it_may_never_learn(self, delayed_frees: set[str]) -> set[str]:
        """Delayed frees to report sent for a worker whose step's stores failed.

        vLLM finishes a request (and asks to delay its free) before it delivers the
        step's report, so a store failure there re-sends the free with the next plan;
        a worker whose bind or ``wait_for_save`` keeps raising never learns it, and
        vLLM would hold the blocks (and wait for them) forever. Once the connector
        has nothing in flight (``has_pending_work`` says no; absent or raising counts
        as busy), no store still reads those blocks: they are reported sent now.
        """
        pending = getattr(self.guard.connector, "has_pending_work", None)
        try:
            busy = pending is None or bool(pending())
        except Exception:  # noqa: BLE001 - a raising answer counts as busy
            busy = True
        return set() if busy else set(delayed_frees)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The step's load errors (read in :meth:`get_transfer_results`)."""
        errors, self._step_invalid = self._step_invalid, set()
        return errors

    def get_kv_connector_kv_cache_events(self) -> AdapterKVEvents | None:
        """The wrapped worker's events (its optional hook of that name), or None."""
        events = to_vllm_events(self.guard.get_kv_connector_kv_cache_events())
        return AdapterKVEvents(events) if events else None

    def build_connector_worker_meta(self) -> AdapterWorkerMetadata | None:
        """The wrapped worker metadata and the guard's step flags, foldable across
        workers (None when there is nothing)."""
        guard = self.guard
        meta = guard.build_connector_worker_meta()
        if meta is None and not (guard.loads_failed or guard.stores_failed):
            return None
        plan = self._meta
        step = plan.step if isinstance(plan, AdapterMetadata) else None
        return AdapterWorkerMetadata(meta, guard.loads_failed, guard.stores_failed, step)

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The wrapped connector's stats (through the guard)."""
        return self.guard.get_kv_connector_stats()
