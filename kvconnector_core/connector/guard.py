"""The failure contract's one home: a guarded scheduler side and a guarded worker side.

The scheduler, the model runner and MultiConnector's children never call a connector
hook directly; they call the typed method of the same name on a
:class:`GuardedScheduler` or a :class:`GuardedWorker`. Each method runs the hook,
contains what it raises (logged with the connector's label, counted per hook in
:attr:`GuardedScheduler.errors` / :attr:`GuardedWorker.errors`) and returns the
documented safe answer, then makes the connector's state safe again. The per-hook table
is ``docs/failure-contract.md``; this module does what it says.

The model: a hook that raises is treated as if it had not run (the built-in connectors
check before they change state), and whatever it was for is treated as failed - a miss,
a failed load (its blocks reported invalid, recomputed), or a failed store (never made
visible). Where that is not enough to keep the connector's own bookkeeping right, the
guard tells it through two optional scheduler-side hooks of
:class:`~kvconnector_core.connector.base.KVConnectorBase_V1`:

- ``forget_requests(ids)``: plan nothing more for these requests and never make a store
  of theirs visible that has not completed yet (the guard also stops showing them to the
  connector: they are *detached*; only ``request_finished`` still reaches it).
- ``plan_failed(plan, loads_failed=, stores_failed=)``: the worker side could not carry
  out part of a plan; release what its loads or stores hold.

Primitives: :class:`GuardedScheduler`, :class:`GuardedWorker` (in
:mod:`kvconnector_core.connector._guard_worker`), :data:`MAX_UNDELIVERED_OUTPUTS`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from kvconnector_core.connector._guard_base import GuardBase
from kvconnector_core.connector._guard_worker import GuardedWorker
from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorOutput
from kvconnector_core.kv_events import AllBlocksCleared

if TYPE_CHECKING:
    from kvconnector_core.connector.base import KVConnectorBase_V1
    from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = ["EVENT_SNAPSHOT_ATTEMPTS", "MAX_UNDELIVERED_OUTPUTS", "GuardedScheduler", "GuardedWorker"]

logger = logging.getLogger(__name__)

EVENT_SNAPSHOT_ATTEMPTS = 4
"""Tries of ``get_event_snapshot`` per resync call before the stream carries a gap marker."""

R = TypeVar("R")

MAX_UNDELIVERED_OUTPUTS = 64
"""Worker reports kept for redelivery after ``update_connector_output`` raised; beyond
this the oldest is dropped (logged, counted as ``update_connector_output.dropped``)."""


def _replace(record: R, **changes: Any) -> R:
    """A copy of ``record`` with ``changes``: kvconnector's records are msgspec Structs;
    another engine's (vLLM's dataclasses, or a view with ``replace``) work too."""
    if isinstance(record, msgspec.Struct):
        return msgspec.structs.replace(record, **changes)
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return dataclasses.replace(record, **changes)
    view: Any = record  # duck-typed: any record with a ``replace`` method
    replaced: R = view.replace(**changes)
    return replaced


class GuardedScheduler(GuardBase):
    """A scheduler-side connector behind the failure contract; one typed method per hook.

    Args:
        connector: the scheduler-role connector.
        label: names the connector in log lines and errors (default: its ``name``).
        errors: the dict to count errors in (hook name -> count); default: a new one.
    """

    def __init__(self, connector: KVConnectorBase_V1, *, label: str | None = None,
                 errors: dict[str, int] | None = None) -> None:
        super().__init__(connector, label=label, errors=errors)
        self.detached: set[str] = set()
        """Requests the connector is no longer shown (see the module docstring)."""
        self._undelivered: list[KVConnectorOutput] = []
        self._repairs: list[tuple[str, Callable[[], None]]] = []
        self._resync_events = False
        self._gap_open = False  # the gap marker was published; no snapshot since
        self._media: set[str] = set()  # media the connector's events named

    @property
    def supports_async_load(self) -> bool:
        """The connector's capability (read on the instance: wrappers set it per instance)."""
        return bool(self.connector.supports_async_load)

    def forget_requests(self, request_ids: Iterable[str]) -> None:
        """Detach the requests and tell the connector to forget them (contained)."""
        ids = set(request_ids) - self.detached
        if ids:
            self.detached |= ids
            self._repairs.append(("forget_requests", lambda: self.connector.forget_requests(ids)))
            self._run_repairs()

    def _own_pending(self) -> bool:
        """A report to redeliver, a repair to retry or an event resync to finish."""
        return bool(self._undelivered or self._repairs or self._resync_events)

    def _run_repairs(self) -> None:
        """Run the pending repair calls (``forget_requests``, ``plan_failed``) in order; one
        that raises is retried, with the ones after it, at the next call (before the next
        report), so what a failed plan or a forgotten request holds is released at last."""
        while self._repairs:
            hook, call = self._repairs[0]
            _, ok = self._contained(hook, "retried next step", call, None)
            if not ok:
                return
            self._repairs.pop(0)

    # ------------------------------------------------------------------ hooks

    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:
        """Give the connector the block pool; not contained (a connector that cannot
        bind is misconfigured, and running without it would hide that).

        Raises:
            ConnectorHookError: the hook raised (the original is the cause).
        """
        self._not_contained("bind_gpu_block_pool", lambda: self.connector.bind_gpu_block_pool(gpu_block_pool))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """The connector's hit beyond the local one; a raise or a malformed answer is a miss.

        Detached requests get a miss without asking.
        """
        if self.quarantined or request.request_id in self.detached:
            return 0, False
        hook = "get_num_new_matched_tokens"
        # The per-step hooks inline their try (no closure, no _contained frame per call):
        # the same log line, count and streak as _contained.
        try:
            answer = self.connector.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised(hook, "treated as a miss")
            return 0, False
        if self._streaks:
            self._streaks.pop(hook, None)
        if not (isinstance(answer, tuple) and len(answer) == 2
                and (answer[0] is None or isinstance(answer[0], int))):
            logger.error("connector %s: %s returned %r, not (int | None, bool); treated as a miss",
                         self.label, hook, answer)
            self._count(hook)
            return 0, False
        num, load_async = answer
        if num is None:
            return None, False
        return max(0, num), bool(load_async) and num > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> bool:
        """Tell the connector about an admission; False when it raised.

        On a raise the request is forgotten (no load, no store by this connector); the
        caller must not count on the ``num_external_tokens`` it offered.
        """
        rid = request.request_id
        if self.quarantined or rid in self.detached:
            return num_external_tokens == 0
        try:
            self.connector.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised("update_state_after_alloc", "the request is forgotten; nothing is loaded")
            self.forget_requests((rid,))
            return False
        if self._streaks:
            self._streaks.pop("update_state_after_alloc", None)
        return True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata | None:
        """The step's plan, or None when the hook raised.

        On a raise every request of the step (scheduled and preempted) is forgotten: the
        connector's view of their blocks may have missed this step, so storing them later
        could store wrong blocks under a hash. Detached requests are left out of the
        output the connector sees.
        """
        so = scheduler_output
        if self.quarantined:  # every request is forgotten; the connector only drains
            self.forget_requests([*(r.req_id for r in so.scheduled_new_reqs),
                                  *so.scheduled_cached_reqs.req_ids, *so.preempted_req_ids])
        shown = self._visible(scheduler_output) if self.detached else scheduler_output
        try:
            plan = self.connector.build_connector_meta(shown)
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised("build_connector_meta", "no plan this step; the step's requests are forgotten")
            self.forget_requests([*(r.req_id for r in so.scheduled_new_reqs),
                                  *so.scheduled_cached_reqs.req_ids, *so.preempted_req_ids])
            return None
        if self._streaks:
            self._streaks.pop("build_connector_meta", None)
        return plan

    def _visible(self, so: SchedulerOutput) -> SchedulerOutput:
        """``so`` without the detached requests' scheduled work (finished and preempted
        ids stay: the connector may hold transfers for them)."""
        hidden = self.detached
        cached = so.scheduled_cached_reqs
        if not hidden or not (any(n.req_id in hidden for n in so.scheduled_new_reqs)
                              or any(r in hidden for r in cached.req_ids)):
            return so
        keep = [i for i, r in enumerate(cached.req_ids) if r not in hidden]
        shown = _replace(
            cached,
            req_ids=[cached.req_ids[i] for i in keep],
            resumed_req_ids=cached.resumed_req_ids - hidden,
            new_token_ids=[cached.new_token_ids[i] for i in keep] if cached.new_token_ids else [],
            new_block_ids=[cached.new_block_ids[i] for i in keep],
            num_computed_tokens=[cached.num_computed_tokens[i] for i in keep],
            num_output_tokens=[cached.num_output_tokens[i] for i in keep] if cached.num_output_tokens else [],
        )
        num_scheduled = {r: n for r, n in so.num_scheduled_tokens.items() if r not in hidden}
        return _replace(
            so, scheduled_new_reqs=[n for n in so.scheduled_new_reqs if n.req_id not in hidden],
            scheduled_cached_reqs=shown, num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()))

    def plan_failed(self, plan: KVConnectorMetadata, *, loads_failed: bool, stores_failed: bool) -> None:
        """Tell the connector the worker could not carry out part of ``plan`` (retried
        until it succeeds, see :meth:`_run_repairs`)."""
        self._repairs.append(("plan_failed", lambda: self.connector.plan_failed(
            plan, loads_failed=loads_failed, stores_failed=stores_failed)))
        self._run_repairs()

    def update_connector_output(self, connector_output: KVConnectorOutput,
                                plan: KVConnectorMetadata | None = None) -> None:
        """Deliver the worker's report; a report the connector raised on is delivered
        again, before the next one, so no completion is ever lost.

        Args:
            connector_output: the worker's report of the step.
            plan: the plan of that step; with ``loads_failed`` / ``stores_failed`` set in
                the report, the connector first gets ``plan_failed(plan, ...)``.
        """
        if plan is not None and (connector_output.loads_failed or connector_output.stores_failed):
            self.plan_failed(plan, loads_failed=connector_output.loads_failed,
                             stores_failed=connector_output.stores_failed)
        elif self._repairs:
            self._run_repairs()
        if not self._undelivered:  # most steps: nothing to redeliver first
            try:
                self.connector.update_connector_output(connector_output)
            except Exception:  # noqa: BLE001 - containing it is the contract
                self._raised("update_connector_output", "the report is delivered again next step")
                self._undelivered.append(connector_output)
            else:
                if self._streaks:
                    self._streaks.pop("update_connector_output", None)
            return
        self._undelivered.append(connector_output)
        while self._undelivered:
            report = self._undelivered[0]
            _, ok = self._contained("update_connector_output", "the report is delivered again next step",
                                    functools.partial(self.connector.update_connector_output, report), None)
            if not ok:
                break
            self._undelivered.pop(0)
        if len(self._undelivered) > MAX_UNDELIVERED_OUTPUTS:
            self._undelivered.pop(0)
            logger.error("connector %s: the oldest undelivered report is dropped", self.label)
            self._count("update_connector_output.dropped")

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)``; on a raise ``(False, None)`` and the request
        is forgotten first, so stores still reading its blocks never become visible."""
        rid = request.request_id
        try:
            answer = self.connector.request_finished(request, block_ids)
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised("request_finished", "blocks freed now; its pending stores never become visible")
            self.forget_requests((rid,))
            answer = (False, None)
        else:
            if self._streaks:
                self._streaks.pop("request_finished", None)
        if self.detached:
            self.detached.discard(rid)
        if not (isinstance(answer, tuple) and len(answer) == 2):
            logger.error("connector %s: request_finished returned %r, not (bool, dict | None)",
                         self.label, answer)
            self.forget_requests((rid,))
            self.detached.discard(rid)
            return False, None
        delay, params = answer
        return bool(delay), params if isinstance(params, dict) else None

    def take_events(self) -> list[KVCacheEvent]:
        """The connector's events; after a raise, a resync instead (see the docs).

        When ``take_events`` raises, its events may be lost, so a replica could stay
        wrong. The guard then returns the connector's ``get_event_snapshot()`` instead:
        per medium a clear and every block it holds now. It does not drain the
        connector first: a snapshot supersedes every event the connector has not
        returned (the hook's contract). A snapshot that raises is retried up to
        :data:`EVENT_SNAPSHOT_ATTEMPTS` times in the same call; if none succeeds, the
        stream says so once (see :meth:`_resync`) and the resync is retried at every
        later call until it succeeds, without asking ``take_events`` meanwhile.
        """
        if not self._resync_events:
            try:
                events = self.connector.take_events()
                events = list(events) if events else []
            except Exception:  # noqa: BLE001 - containing it is the contract
                self._raised("take_events", "events replaced by a snapshot")
            else:
                if self._streaks:
                    self._streaks.pop("take_events", None)
                if events:
                    self._note_media(events)
                return events
            self._resync_events = True
        return self._resync()

    def get_event_snapshot(self) -> list[KVCacheEvent]:
        """The connector's snapshot, retried like :meth:`take_events`'s resync; when it
        cannot be had, the gap clears (see :meth:`_resync`) and a resync is left pending,
        so the next :meth:`take_events` is a snapshot."""
        self._resync_events = True
        return self._resync()

    def _resync(self) -> list[KVCacheEvent]:
        """A snapshot in place of lost events, or (once per gap) the gap marker.

        The gap marker is an ``AllBlocksCleared(medium=M)`` for every medium the
        connector's events have named so far: a consumer then holds nothing for those
        media (never a block the connector may no longer hold) until the snapshot
        comes. Counted as ``event_gap``.
        """
        for _ in range(EVENT_SNAPSHOT_ATTEMPTS):
            events = self._snapshot()
            if events is not None:
                self._resync_events = self._gap_open = False
                self._note_media(events)
                return events
        if self._gap_open:
            return []
        self._gap_open = True
        self._count("event_gap")
        logger.error("connector %s: no event snapshot after %d attempts; media %s published as "
                     "cleared until a snapshot succeeds", self.label, EVENT_SNAPSHOT_ATTEMPTS,
                     sorted(self._media))
        return [AllBlocksCleared(medium=m) for m in sorted(self._media)]

    def _note_media(self, events: list[KVCacheEvent]) -> None:
        for event in events:
            medium = getattr(event, "medium", None)
            if medium is not None:
                self._media.add(medium)

    def _snapshot(self) -> list[KVCacheEvent] | None:
        # getattr: the hook is optional and connectors older than it may not define it.
        snapshot = getattr(self.connector, "get_event_snapshot", None)
        if snapshot is None:
            return []
        events, ok = self._contained("get_event_snapshot", "retried",
                                     lambda: list(snapshot()), [])
        return events if ok else None

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The connector's scheduler-side stats; None on a raise."""
        try:
            stats = self.connector.get_kv_connector_stats()
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised("get_kv_connector_stats", "no stats")
            return None
        if self._streaks:
            self._streaks.pop("get_kv_connector_stats", None)
        return stats if isinstance(stats, dict) else None

    def reset_cache(self) -> bool:
        """Let the connector drop its cache and pins before a prefix-cache reset; a raise
        or an answer of False is False (the reset does not happen)."""
        result, _ = self._contained("reset_cache", "the prefix-cache reset is refused",
                                    self.connector.reset_cache, False)
        return result is not False

    def shutdown(self) -> None:
        """Shut the connector down (not contained: the caller collects failures)."""
        self.connector.shutdown()
