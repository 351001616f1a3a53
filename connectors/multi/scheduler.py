"""Scheduler side of :class:`~connectors.multi.MultiConnector`.

Every child is called through its own
:class:`~kvconnector_core.connector.guard.GuardedScheduler`, so a child that raises is
contained exactly as a top-level connector would be (a miss, no plan, a report delivered
again, a forgotten request), counted per child in the stats' ``hook_errors``. The
multi's own bookkeeping for a request (its loader) ends with ``request_finished`` or
``forget_requests``; nothing per request survives a child that raised.

Primitives: :class:`MultiSchedulerSide`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from connectors.multi.fanout import STANDARD_STAT_KEYS, aggregate_stats, call_each, new_hook_errors
from connectors.multi.records import (
    NIL,
    MultiKVConnectorMetadata,
    MultiKVConnectorWorkerMetadata,
    MultiLoad,
)
from kvconnector_core.connector.base import KVConnectorSchedulerSide
from kvconnector_core.connector.guard import GuardedScheduler
from kvconnector_core.connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    decode_metadata,
    encode_metadata,
)

if TYPE_CHECKING:
    from connectors.multi.policy import LoaderSelectionPolicy
    from kvconnector_core.connector.base import KVConnectorBase_V1
    from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["MultiSchedulerSide"]

logger = logging.getLogger(__name__)
# Plans kept by step for reports that come back late (vLLM keeps at most two steps in
# flight with async scheduling, more with pipeline parallelism).
_PLANS_KEPT = 16


class MultiSchedulerSide(KVConnectorSchedulerSide):
    """Fans the scheduler hooks out to the children (see :mod:`connectors.multi.connector`).

    Args:
        children: the scheduler-role children, in priority order.
        labels: a unique label per child.
        policy: chooses the loading child.
        block_size: the first KV cache group's block size, or None when unknown.
    """

    def __init__(self, children: Sequence[KVConnectorBase_V1], labels: Sequence[str],
                 policy: LoaderSelectionPolicy, block_size: int | None) -> None:
        self.guards = [GuardedScheduler(c, label=label) for c, label in zip(children, labels)]
        self._policy = policy
        self._errors_reported: dict[str, int] = {}  # see new_hook_errors
        self._block_size = block_size
        self._loader: dict[str, tuple[int, int, bool]] = {}  # req -> (child, local tokens, async)
        self._step_delayed: dict[str, list[int]] = {}
        self._step_loads: dict[str, MultiLoad] = {}
        self._step_failed: dict[str, MultiLoad] = {}
        self._settled: list[str] = []  # delayed frees reported since the last plan
        # Each child's plan of the last step (None when it built none), for plan_failed;
        # and of recent steps by plan number: with async scheduling a report comes back
        # after later plans were built, and a child's failure must reach its own step's plan.
        self._last_plans: list[KVConnectorMetadata | None] = [None] * len(self.guards)
        self._plans_by_step: dict[int, list[KVConnectorMetadata | None]] = {}
        self._step = 0

    def num_request_states(self) -> int:
        """Requests this object (and its children's guards) still keep state for."""
        return len(self._loader) + sum(len(g.detached) for g in self.guards)

    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:
        """Give every child the pool, then raise the first failure."""
        call_each(functools.partial(g.bind_gpu_block_pool, gpu_block_pool) for g in self.guards)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Ask every child; return the chosen loader's answer (see
        :mod:`connectors.multi.connector`)."""
        hits: list[tuple[int | None, bool]] = []
        for guard in self.guards:
            hit = guard.get_num_new_matched_tokens(request, num_computed_tokens)
            if hit[0] is None:
                return None, False
            hits.append(hit)
        chosen = self._policy.select(hits)
        if chosen is None or not hits[chosen][0]:
            self._loader.pop(request.request_id, None)
            return 0, False
        num_tokens, is_async = hits[chosen]
        self._loader[request.request_id] = (chosen, num_computed_tokens, is_async)
        return num_tokens, is_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Give the loader the external tokens and every other child 0, all with the same blocks."""
        loader = self._loader.get(request.request_id)
        loader_index = loader[0] if loader is not None and num_external_tokens > 0 else None
        for i, guard in enumerate(self.guards):
            ext = num_external_tokens if i == loader_index else 0
            ok = guard.update_state_after_alloc(request, blocks, ext)
            if i == loader_index and loader is not None:
                load = self._make_load(loader, blocks, num_external_tokens)
                target = self._step_loads if ok else self._step_failed
                target[request.request_id] = load

    def _make_load(self, loader: tuple[int, int, bool], blocks: KVCacheBlocks,
                   num_external: int) -> MultiLoad:
        child, num_local, is_async = loader
        block_ids = list(blocks.get_block_ids()[0])
        if self._block_size:
            # Only the blocks the load writes; without the block size, all (a superset is safe).
            start = num_local // self._block_size
            end = -(-(num_local + num_external) // self._block_size)
            block_ids = block_ids[start:end]
        return MultiLoad(child=child, block_ids=block_ids, is_async=is_async)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiKVConnectorMetadata:
        """Build every child's plan and this step's completion bookkeeping."""
        children: list[msgspec.Raw] = []
        skipped: list[int] = []
        for i, guard in enumerate(self.guards):
            meta = guard.build_connector_meta(scheduler_output)
            declared = guard.connector.metadata_type
            if meta is not None and type(meta) is not declared:
                hook = "build_connector_meta"
                guard.errors[hook] = guard.errors.get(hook, 0) + 1
                logger.error("MultiConnector: child %s returned %s but declares "
                             "metadata_type=%s; set metadata_type on the connector class",
                             guard.label, type(meta).__qualname__, declared.__qualname__)
                meta = None
            self._last_plans[i] = meta
            if meta is None:
                # The child's plan is lost, so its loads planned this step cannot happen:
                # they fail now, and the child must not send them with a later plan.
                lost = [r for r, load in self._step_loads.items() if load.child == i]
                for req_id in lost:
                    self._step_failed[req_id] = self._step_loads.pop(req_id)
                guard.forget_requests(lost)
                children.append(NIL)
                skipped.append(i)
            else:
                children.append(msgspec.Raw(encode_metadata(meta)))
        out = MultiKVConnectorMetadata(children=children, skipped_children=skipped,
                                       delayed_sends=self._step_delayed, loads=self._step_loads,
                                       failed_loads=self._step_failed, settled_sends=self._settled,
                                       step=self._step)
        self._plans_by_step[self._step] = list(self._last_plans)
        # Steps only grow: drop the one that fell out of the window (its report never came).
        self._plans_by_step.pop(self._step - _PLANS_KEPT, None)
        self._step += 1
        self._step_delayed, self._step_loads, self._step_failed, self._settled = {}, {}, {}, []
        return out

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forward the worker's report to every child, each with its own stats, worker
        metadata and plan failures."""
        stats = connector_output.kv_connector_stats
        per_child_stats = stats.get("children") if isinstance(stats, dict) else None
        if not isinstance(per_child_stats, dict):
            per_child_stats = {}
        worker_meta = connector_output.kv_connector_worker_meta
        if worker_meta is None:
            worker_meta = MultiKVConnectorWorkerMetadata(())
        elif not isinstance(worker_meta, MultiKVConnectorWorkerMetadata):
            logger.error("MultiConnector: kv_connector_worker_meta is %s, not "
                         "MultiKVConnectorWorkerMetadata; ignored", type(worker_meta).__qualname__)
            worker_meta = MultiKVConnectorWorkerMetadata(())
        metas = worker_meta.metadata
        plans = self._plans_by_step.get(worker_meta.step, self._last_plans)
        for i, guard in enumerate(self.guards):
            own = msgspec.structs.replace(
                connector_output,
                kv_connector_stats=per_child_stats.get(guard.label),
                kv_connector_worker_meta=metas[i] if i < len(metas) else None,
                loads_failed=i in worker_meta.loads_failed,
                stores_failed=i in worker_meta.stores_failed,
            )
            guard.update_connector_output(own, plans[i])
        for req_id in connector_output.finished_sending:
            # A delayed free re-sent by plan_failed but reported meanwhile: nothing to send,
            # and the worker side must stop waiting if the re-send already went out.
            self._step_delayed.pop(req_id, None)
            if req_id not in self._settled:
                self._settled.append(req_id)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delay the free if any child asks; merge the children's params (earlier child wins
        a key)."""
        self._loader.pop(request.request_id, None)
        delayed: list[int] = []
        params: dict[str, Any] = {}
        for i, guard in enumerate(self.guards):
            delay, child_params = guard.request_finished(request, block_ids)
            if delay:
                delayed.append(i)
            for key, value in (child_params or {}).items():
                if key in params:
                    logger.warning("MultiConnector: child %s's kv_transfer_params key %r "
                                   "clashes; kept the earlier child's", guard.label, key)
                    continue
                params[key] = value
        if delayed:
            self._step_delayed[request.request_id] = delayed
        return bool(delayed), params or None

    def forget_requests(self, request_ids: set[str]) -> None:
        """Forget the requests in every child and drop their unsent loads."""
        for rid in request_ids:
            self._loader.pop(rid, None)
            load = self._step_loads.pop(rid, None)
            if load is not None:
                self._step_failed[rid] = load
        for guard in self.guards:
            guard.forget_requests(request_ids)

    def plan_failed(self, connector_metadata: KVConnectorMetadata, *, loads_failed: bool,
                    stores_failed: bool) -> None:
        """Pass the failure to every child with its own plan; re-send the plan's delayed frees."""
        plan = connector_metadata
        if not isinstance(plan, MultiKVConnectorMetadata) or len(plan.children) != len(self.guards):
            return
        for i, (guard, raw) in enumerate(zip(self.guards, plan.children)):
            if i not in plan.skipped_children:
                child_plan = decode_metadata(raw, guard.connector.metadata_type)
                guard.plan_failed(child_plan, loads_failed=loads_failed,
                                  stores_failed=stores_failed)
        if stores_failed:
            for req_id, children in plan.delayed_sends.items():
                self._step_delayed.setdefault(req_id, children)
            self._settled += [r for r in plan.settled_sends if r not in self._settled]

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Chain the children's events, in child order (each resyncs on its own failure)."""
        return [event for guard in self.guards for event in guard.take_events()]

    def get_event_snapshot(self) -> Iterable[KVCacheEvent]:
        """Chain the children's snapshots, in child order."""
        return [event for guard in self.guards for event in guard.get_event_snapshot()]

    def reset_cache(self) -> bool:
        """Reset every child (each through its guard); False if any child refused or raised."""
        results = [guard.reset_cache() for guard in self.guards]
        return all(results)

    def has_pending_work(self) -> bool:
        """Whether a child (or its guard) has something to deliver in a later step."""
        pending = [g.has_pending_work() for g in self.guards]  # a list: ask every guard
        return bool(self._settled or self._step_delayed or self._step_failed) or any(pending)

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """``{"children": {label: stats}}``, the sums of the standard keys, and ``hook_errors``."""
        per_child = {g.label: s for g in self.guards if (s := g.get_kv_connector_stats())}
        errors = new_hook_errors(self.guards, self._errors_reported)
        return aggregate_stats(per_child, errors, STANDARD_STAT_KEYS)
