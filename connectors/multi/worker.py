"""Worker side of :class:`~connectors.multi.MultiConnector`.

Every child is called through its own
:class:`~kvconnector_core.connector.guard.GuardedWorker`. A child whose bind or load
hook raises has its loads of the step reported failed by the multi (their blocks in
``get_block_ids_with_load_errors``, async loads as failed receives), so the scheduler
recomputes instead of reading KV that never arrived; a child whose save hooks raise has
its stores failed. Both travel per child in :class:`MultiKVConnectorWorkerMetadata`, so
the scheduler side can tell that child ``plan_failed``.

Primitives: :class:`MultiWorkerSide`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from connectors.multi.fanout import aggregate_stats, call_each, new_hook_errors
from connectors.multi.records import (
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
    MultiLoad,
)
from kvconnector_core.connector.base import KVConnectorWorkerSide
from kvconnector_core.connector.guard import GuardedWorker
from kvconnector_core.connector.metadata import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
    decode_metadata,
)
from kvconnector_core.errors import ConnectorHookError, InvariantError

if TYPE_CHECKING:
    import torch

    from kvconnector_core.connector.base import KVConnectorBase_V1

__all__ = ["MultiWorkerSide"]


class MultiWorkerSide(KVConnectorWorkerSide):
    """Fans the worker hooks out to the children (see :mod:`connectors.multi.connector`).

    Args:
        children: the worker-role children, in priority order.
        labels: a unique label per child.
    """

    def __init__(self, children: Sequence[KVConnectorBase_V1], labels: Sequence[str]) -> None:
        self.guards = [GuardedWorker(c, label=label) for c, label in zip(children, labels)]
        self._awaiting_send: dict[str, set[int]] = {}
        self._errors_reported: dict[str, int] = {}  # see new_hook_errors
        self._bound = [False] * len(self.guards)
        self._child_plans: list[KVConnectorMetadata | None] = [None] * len(self.guards)
        self._failed_loaders: set[int] = set()
        self._forced_recv: set[str] = set()  # receives this connector reported failed itself
        self._forced_failed: set[str] = set()
        self._forced_invalid: set[int] = set()

    def num_request_states(self) -> int:
        """Requests this object still keeps state for."""
        return len(self._awaiting_send) + len(self._forced_recv) + len(self._forced_failed)

    def _check(self, plan: KVConnectorMetadata) -> MultiKVConnectorMetadata:
        if not isinstance(plan, MultiKVConnectorMetadata) or len(plan.children) != len(self.guards):
            msg = (f"MultiConnector expected MultiKVConnectorMetadata for {len(self.guards)} "
                   f"children, got {type(plan).__qualname__}")
            raise InvariantError(msg)
        return plan

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Give every child the KV tensors, then raise the first failure."""
        call_each(functools.partial(g.register_kv_caches, kv_caches) for g in self.guards)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Decode and bind each child's plan; record this step's bookkeeping.

        Raises:
            InvariantError: the plan is not a MultiKVConnectorMetadata for this many children.
        """
        plan = self._check(connector_metadata)
        self.plan = plan
        self._failed_loaders = set()
        for req_id, children in plan.delayed_sends.items():
            self._awaiting_send[req_id] = set(children)
        for req_id in plan.settled_sends:
            self._awaiting_send.pop(req_id, None)
        for req_id, load in plan.failed_loads.items():
            self._fail_load(req_id, load)
        for i, (guard, raw) in enumerate(zip(self.guards, plan.children)):
            # the guard above the multi reads the children's load errors before the saves
            guard.begin_step(sync_loads=False)
            self._bound[i] = False
            self._child_plans[i] = None
            if i in plan.skipped_children:
                continue
            child_plan = decode_metadata(raw, guard.connector.metadata_type)
            self._child_plans[i] = child_plan
            self._bound[i] = guard.bind_connector_metadata(child_plan)
            self._note_load_failure(i)

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:
        """Forward to every child with a plan this step, with its own plan."""
        plan = self._check(connector_metadata)
        for i, (guard, raw) in enumerate(zip(self.guards, plan.children)):
            if i in plan.skipped_children:
                continue
            child_plan = self._child_plans[i] if plan is self.plan else None
            if child_plan is None:
                child_plan = decode_metadata(raw, guard.connector.metadata_type)
            guard.handle_preemptions(child_plan)

    def _fail_load(self, req_id: str, load: MultiLoad) -> None:
        self._forced_invalid.update(load.block_ids)
        if load.is_async:
            self._forced_recv.add(req_id)
            self._forced_failed.add(req_id)

    def _note_load_failure(self, index: int) -> None:
        """Once per step: a child whose loads failed has all its loads of the step failed."""
        if not self.guards[index].loads_failed or index in self._failed_loaders:
            return
        self._failed_loaders.add(index)
        loads = self.plan.loads if isinstance(self.plan, MultiKVConnectorMetadata) else {}
        for req_id, load in loads.items():
            if load.child == index:
                self._fail_load(req_id, load)

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Start every child's loads."""
        for i, guard in enumerate(self.guards):
            guard.start_load_kv(forward_context)
            self._note_load_failure(i)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for every child's loads of ``layer_name``."""
        for i, guard in enumerate(self.guards):
            guard.wait_for_layer_load(layer_name)
            self._note_load_failure(i)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any = None) -> None:
        """Let every child save ``layer_name``."""
        for guard in self.guards:
            guard.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        """End every child's saves of the step."""
        for guard in self.guards:
            guard.wait_for_save()

    def clear_connector_metadata(self) -> None:
        """Unbind every child's plan."""
        for i, guard in enumerate(self.guards):
            if self._bound[i]:
                guard.clear_connector_metadata()
            self._bound[i] = False
        self._child_plans = [None] * len(self.guards)
        self.plan = None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Union receives; report a send once every child that delayed it has reported it."""
        out = KVConnectorTransferResults()
        for i, guard in enumerate(self.guards):
            res = guard.get_transfer_results(finished_req_ids)
            for req_id in res.finished_sending:
                waiting = self._awaiting_send.get(req_id)
                if waiting is None or i not in waiting:
                    continue  # not a delayed free of this child: reporting it could double-free
                waiting.discard(i)
                if not waiting:
                    del self._awaiting_send[req_id]
                    out.finished_sending.add(req_id)
            for req_id in res.finished_recving:
                if req_id in self._forced_recv:
                    self._forced_recv.discard(req_id)
                    continue  # already reported as a failed receive
                out.finished_recving.add(req_id)
                if req_id in res.failed_recving:
                    out.failed_recving.add(req_id)
        out.finished_recving |= self._forced_failed
        out.failed_recving |= self._forced_failed
        self._forced_failed = set()
        # A receive the child never reports (its load never started) is forgotten once the
        # request finished: the scheduler ignores a finished request's late receive.
        self._forced_recv -= finished_req_ids
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Union of the children's load errors and the loads this connector failed.

        Raises:
            ConnectorHookError: a child could not tell its load errors; the guard above
                then fails every load of the step (which loads failed is unknown).
        """
        errors, self._forced_invalid = self._forced_invalid, set()
        unknown = None
        for guard in self.guards:
            errors |= guard.get_block_ids_with_load_errors()
            if guard.load_errors_unknown:
                unknown = guard.label
        if unknown is not None:
            msg = f"MultiConnector child {unknown} could not report its load errors"
            raise ConnectorHookError(msg, unknown, "get_block_ids_with_load_errors")
        return errors

    def build_connector_worker_meta(self) -> MultiKVConnectorWorkerMetadata | None:
        """Each child's worker metadata and plan failures; None when there is nothing."""
        metas = tuple(guard.build_connector_worker_meta() for guard in self.guards)
        loads_failed = tuple(i for i, g in enumerate(self.guards) if g.loads_failed)
        stores_failed = tuple(i for i, g in enumerate(self.guards) if g.stores_failed)
        for guard in self.guards:
            guard.begin_step()  # reported once
        if all(m is None for m in metas) and not loads_failed and not stores_failed:
            return None
        step = self.plan.step if isinstance(self.plan, MultiKVConnectorMetadata) else -1
        return MultiKVConnectorWorkerMetadata(metas, loads_failed, stores_failed, step)

    def get_kv_connector_kv_cache_events(self) -> list[Any]:
        """Every child's worker-side events (e.g. an offload child's disk and Redis tiers)."""
        return [e for g in self.guards for e in g.get_kv_connector_kv_cache_events()]

    def has_pending_work(self) -> bool:
        """Whether a child (or its guard) has something to deliver in a later step."""
        # A list, not a generator: every guard is asked (each counts its pending asks).
        return any([g.has_pending_work() for g in self.guards])  # noqa: C419

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """``{"children": {label: stats}}``, the sums of the standard keys, and ``hook_errors``."""
        per_child = {g.label: s for g in self.guards if (s := g.get_kv_connector_stats())}
        errors = new_hook_errors(self.guards, self._errors_reported)
        return aggregate_stats(per_child, errors)
