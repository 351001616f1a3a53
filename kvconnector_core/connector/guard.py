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

**The worker side.** Per step the model runner calls :meth:`GuardedWorker.begin_step`,
then the hooks of the step (each a typed method); what failed is left in three flags that
the runner puts into the step's :class:`KVConnectorOutput`:

- ``loads_failed``: the step's loads may not have run or finished (``bind_connector_metadata``,
  ``start_load_kv`` or ``wait_for_layer_load`` raised, or which loads failed is unknown).
  Sync loads' blocks are reported invalid by the runner; the scheduler reports the async
  loads it planned this step as failed receives, and the scheduler side gets
  ``plan_failed(plan, loads_failed=True)``.
- ``stores_failed``: the step's stores may not have run or may have read blocks that
  changed (``bind_connector_metadata``, ``handle_preemptions``, ``save_kv_layer`` or
  ``wait_for_save`` raised), or they were computed on a failed synchronous load (below);
  the scheduler side gets ``plan_failed(plan, stores_failed=True)`` and must never make
  them visible.
- ``load_errors_unknown``: ``get_block_ids_with_load_errors`` raised; every receive
  reported finished this step is reported failed.

Stores computed on a failed load. In a step with synchronous loads the forward reads the
blocks those loads write; if a load failed, the KV the step computes on top of it is wrong,
and so is every store of the step. So the guard learns the step's load errors *before* it
lets the connector finish its saves: once a load hook raised, later ``save_kv_layer`` calls
are skipped; and ``wait_for_save`` first reads ``get_block_ids_with_load_errors`` (kept for
the step's own call of that hook, which returns them together with any later ones). When a
load failed either way, ``wait_for_save`` is not called and the step's stores fail. A
connector that stores in ``wait_for_save`` therefore never writes KV computed on a failed
load, with no failure handling of its own; one that writes in ``save_kv_layer`` drops the
step's stores in ``plan_failed`` (``stores_failed``).

Both sides derive from :class:`GuardBase`: the connector, its label, the error counts,
the quarantine and the one place where a hook's exception is caught
(:meth:`GuardBase._contained`).

Primitives: :class:`GuardBase`, :class:`GuardedScheduler`, :class:`GuardedWorker`,
:data:`MAX_PENDING_STEPS`, :data:`MAX_UNDELIVERED_OUTPUTS`, :data:`EVENT_SNAPSHOT_ATTEMPTS`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from kvconnector_core.connector.config import DEFAULT_QUARANTINE_AFTER_RAISES
from kvconnector_core.connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorTransferResults,
)
from kvconnector_core.errors import ConnectorHookError
from kvconnector_core.kv_events import AllBlocksCleared

if TYPE_CHECKING:
    import torch

    from kvconnector_core.connector.base import KVConnectorBase_V1
    from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import CachedRequestData, SchedulerOutput

__all__ = [
    "EVENT_SNAPSHOT_ATTEMPTS",
    "MAX_PENDING_STEPS",
    "MAX_UNDELIVERED_OUTPUTS",
    "GuardBase",
    "GuardedScheduler",
    "GuardedWorker",
]

logger = logging.getLogger(__name__)  # kvconnector_core.connector.guard, named in the docs
T = TypeVar("T")
D = TypeVar("D")  # the default's own type: inferring T from both would make a None default fix T
R = TypeVar("R")

MAX_PENDING_STEPS = 64
"""Consecutive asks for which a guard answers that its connector has pending work; past
this the engine is let go idle (logged once), so a connector that never delivers cannot
keep it stepping forever."""

EVENT_SNAPSHOT_ATTEMPTS = 4
"""Tries of ``get_event_snapshot`` per resync call before the stream carries a gap marker."""

MAX_UNDELIVERED_OUTPUTS = 64
"""Worker reports kept for redelivery after ``update_connector_output`` raised; beyond
this the oldest is dropped (logged, counted as ``update_connector_output.dropped``)."""

_LOADS_FAIL = "the step's loads fail"
_STORES_FAIL = "the step's stores fail"
_NEXT_STEP = "the connector reports it next step"


class GuardBase:
    """A connector (one role) behind the failure contract.

    Args:
        connector: the connector instance.
        label: names the connector in log lines and errors (default: its ``name``).
        errors: the dict to count errors in (hook name -> count); default: a new one.
    """

    def __init__(self, connector: KVConnectorBase_V1, *, label: str | None = None,
                 errors: dict[str, int] | None = None) -> None:
        self.connector = connector
        self.label = label or connector.name
        self.errors: dict[str, int] = {} if errors is None else errors
        """Per hook name, how many times the connector raised (contained)."""
        self._pending_asks = 0
        config = getattr(connector, "config", None)
        self.quarantine_after: int | None = getattr(config, "quarantine_after_raises",
                                                    DEFAULT_QUARANTINE_AFTER_RAISES)
        """Raises in a row of one hook after which the connector is quarantined (None: never)."""
        self.quarantined = False
        """Set once one hook raised ``quarantine_after`` times in a row; never cleared."""
        self._streaks: dict[str, int] = {}  # hook -> raises in a row
        # Hooks that raised since the last step began: the worker's hot hooks inline their
        # try (no per-call success bookkeeping), so their streaks end at the next step
        # in which they did not raise (GuardedWorker.begin_step).
        self._raised_now: set[str] = set()

    def has_pending_work(self) -> bool:
        """Whether the engine should run another step for this connector: the guard's own
        redeliveries (:meth:`_own_pending`) or the connector's ``has_pending_work`` (a
        raise counts as no). After :data:`MAX_PENDING_STEPS` consecutive yeses, no."""
        # optional: connectors older than the hook lack it
        hook = getattr(self.connector, "has_pending_work", None)
        pending = self._own_pending() or (hook is not None and bool(
            self._contained("has_pending_work", "taken as no", hook, False)[0]))
        self._pending_asks = self._pending_asks + 1 if pending else 0
        if self._pending_asks == MAX_PENDING_STEPS + 1:
            logger.error("connector %s: still has pending work after %d steps; the engine may "
                         "go idle", self.label, MAX_PENDING_STEPS)
        return pending and self._pending_asks <= MAX_PENDING_STEPS

    def _own_pending(self) -> bool:
        """What the guard itself still has to deliver (subclasses)."""
        return False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label}>"

    def _count(self, hook: str) -> None:
        self.errors[hook] = self.errors.get(hook, 0) + 1

    def _contained(self, hook: str, consequence: str, call: Callable[[], T],
                   default: D) -> tuple[T | D, bool]:
        """Run one hook call; on an exception log it (naming the connector, the hook and
        ``consequence``), count it and return ``(default, False)``."""
        try:
            result = call()
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised(hook, consequence)
            return default, False
        if self._streaks:
            self._streaks.pop(hook, None)
        return result, True

    def _note_raise(self, hook: str) -> None:
        """Quarantine the connector once ``hook`` raised ``quarantine_after`` times in a row
        (for the worker's per-step hooks: in consecutive steps; see ``_raised_now``)."""
        streak = self._streaks[hook] = self._streaks.get(hook, 0) + 1
        if self.quarantined or self.quarantine_after is None or streak < self.quarantine_after:
            return
        self.quarantined = True
        self._count("quarantined")
        logger.error("connector %s quarantined: %s raised %d times in a row; no more loads or "
                     "stores go through it", self.label, hook, streak)

    def _raised(self, hook: str, consequence: str) -> None:
        """Log (with the traceback) and count the exception being handled; called from
        the ``except`` block of a hot hook that inlines its ``try`` instead of building a
        closure for :meth:`_contained` (the per-layer and per-step hooks)."""
        logger.exception("connector %s raised in %s; %s", self.label, hook, consequence)
        self._count(hook)
        self._raised_now.add(hook)
        self._note_raise(hook)

    def _not_contained(self, hook: str, call: Callable[[], None]) -> None:
        """Run a setup hook whose failure means misconfiguration.

        Raises:
            ConnectorHookError: the hook raised (the original is the cause).
        """
        try:
            call()
        except Exception as exc:
            msg = f"connector {self.label} raised in {hook}: {type(exc).__name__}: {exc}"
            raise ConnectorHookError(msg, self.label, hook) from exc


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


def _cached_without(cached: CachedRequestData, hidden: set[str]) -> CachedRequestData:
    """``cached`` without the rows of the ``hidden`` requests (its columns are parallel
    lists; an optional column left empty by the engine stays empty)."""
    keep = [i for i, r in enumerate(cached.req_ids) if r not in hidden]

    def rows(column: list[Any]) -> list[Any]:
        return [column[i] for i in keep] if column else []

    return _replace(
        cached, req_ids=rows(cached.req_ids), resumed_req_ids=cached.resumed_req_ids - hidden,
        new_token_ids=rows(cached.new_token_ids), new_block_ids=rows(cached.new_block_ids),
        num_computed_tokens=rows(cached.num_computed_tokens),
        num_output_tokens=rows(cached.num_output_tokens))


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
        self._not_contained("bind_gpu_block_pool",
                            lambda: self.connector.bind_gpu_block_pool(gpu_block_pool))

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
            self._raised("build_connector_meta",
                         "no plan this step; the step's requests are forgotten")
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
                              or not hidden.isdisjoint(cached.req_ids)):
            return so
        num_scheduled = {r: n for r, n in so.num_scheduled_tokens.items() if r not in hidden}
        return _replace(
            so, scheduled_new_reqs=[n for n in so.scheduled_new_reqs if n.req_id not in hidden],
            scheduled_cached_reqs=_cached_without(cached, hidden),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()))

    def plan_failed(self, plan: KVConnectorMetadata, *, loads_failed: bool,
                    stores_failed: bool) -> None:
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
            _, ok = self._contained(
                "update_connector_output", "the report is delivered again next step",
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
            self._raised("request_finished",
                         "blocks freed now; its pending stores never become visible")
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


class GuardedWorker(GuardBase):
    """A worker-side connector behind the failure contract; one typed method per hook.

    Args:
        connector: the worker-role connector.
        label: names the connector in log lines and errors (default: its ``name``).
        errors: the dict to count errors in (hook name -> count); default: a new one.
    """

    def __init__(self, connector: KVConnectorBase_V1, *, label: str | None = None,
                 errors: dict[str, int] | None = None) -> None:
        super().__init__(connector, label=label, errors=errors)
        self.loads_failed = False
        """This step's loads may not have run (reset by :meth:`begin_step`)."""
        self.stores_failed = False
        """This step's stores may not have run or read changed blocks (reset each step)."""
        self.load_errors_unknown = False
        """``get_block_ids_with_load_errors`` raised this step: which loads failed is unknown."""
        self._has_plan = False
        self._sync_loads = True  # whether this step may have synchronous loads (begin_step)
        # load errors read before wait_for_save, returned with the step's own call
        self._early_errors: set[int] = set()
        # finished_req_ids a raising get_transfer_results did not take: passed again.
        self._unseen_finished: set[str] = set()
        self._uncleared = False  # clear_connector_metadata raised: the plan is still bound
        # The optional vLLM hook (not on the base class), looked up once, not every step.
        self._events_hook = getattr(connector, "get_kv_connector_kv_cache_events", None)

    @property
    def uses_layer_hooks(self) -> bool:
        """False when the connector declares its per-layer hooks do nothing: the runner
        then skips ``wait_for_layer_load`` / ``save_kv_layer`` (two calls per layer per
        step); a hook that is never called cannot fail, so the contract is unchanged."""
        return bool(getattr(self.connector, "uses_layer_hooks", True))

    @property
    def has_sync_kv_loads(self) -> bool:
        """The connector's capability (read on the instance)."""
        return bool(self.connector.has_sync_kv_loads)

    def _own_pending(self) -> bool:
        """Finished request ids a raising ``get_transfer_results`` did not take yet, or a
        plan ``clear_connector_metadata`` could not unbind (the next bind replaces it)."""
        return bool(self._unseen_finished) or self._uncleared

    def begin_step(self, *, sync_loads: bool = True) -> None:
        """Reset the per-step failure flags; a quarantined connector's loads and stores
        fail every step (the scheduler recomputes and drops them).

        Args:
            sync_loads: whether the step may have synchronous loads (the forward then
                reads blocks being loaded, and a failed load fails the step's stores);
                True when unknown.
        """
        self.loads_failed = self.stores_failed = self.quarantined
        self._sync_loads = sync_loads
        self._early_errors = set()
        if self._streaks:  # a hook that did not raise in the last step ends its streak
            for hook in [h for h in self._streaks if h not in self._raised_now]:
                del self._streaks[hook]
        self._raised_now.clear()
        self.load_errors_unknown = False
        self._has_plan = False

    # ------------------------------------------------------------------ hooks

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Give the connector the KV tensors; not contained (a startup error).

        Raises:
            ConnectorHookError: the hook raised (the original is the cause).
        """
        self._not_contained("register_kv_caches",
                            lambda: self.connector.register_kv_caches(kv_caches))

    def bind_connector_metadata(self, plan: KVConnectorMetadata) -> bool:
        """Bind the step's plan; False when it raised (the whole plan failed: the step's
        loads and stores are skipped and reported failed)."""
        try:
            self.connector.bind_connector_metadata(plan)
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised("bind_connector_metadata", "the step's loads and stores fail")
            self._has_plan = False
            self.loads_failed = self.stores_failed = True
            return False
        self._has_plan = True
        return True

    def handle_preemptions(self, plan: KVConnectorMetadata) -> None:
        """Let the connector flush preempted requests' stores (called even when the bind
        failed: the plan is the argument). A raise fails the step's stores."""
        try:
            self.connector.handle_preemptions(plan)
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised("handle_preemptions", _STORES_FAIL)
            self.stores_failed = True

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Start the step's loads; skipped without a bound plan. A raise fails them."""
        if self._has_plan:
            try:
                self.connector.start_load_kv(forward_context)
            except Exception:  # noqa: BLE001 - containing it is the contract
                self._raised("start_load_kv", _LOADS_FAIL)
                self.loads_failed = True

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for one layer's loads; a raise fails the step's loads (later layers skip it)."""
        if self._has_plan and not self.loads_failed:
            try:
                self.connector.wait_for_layer_load(layer_name)
            except Exception:  # noqa: BLE001 - containing it is the contract
                self._raised("wait_for_layer_load", _LOADS_FAIL)
                self.loads_failed = True

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any = None) -> None:
        """Save one layer; a raise fails the step's stores (later layers are not saved).
        Skipped once a synchronous load of the step failed (the layer holds KV computed
        on it)."""
        if self.loads_failed and self._sync_loads:
            self.stores_failed = True
        elif self._has_plan and not self.stores_failed:
            try:
                self.connector.save_kv_layer(layer_name, kv_layer, attn_metadata)
            except Exception:  # noqa: BLE001 - containing it is the contract
                self._raised("save_kv_layer", _STORES_FAIL)
                self.stores_failed = True

    def _saves_poisoned(self) -> bool:
        """A synchronous load of this step failed, so what the step computed is wrong."""
        return self._sync_loads and (self.loads_failed or bool(self._early_errors))

    def wait_for_save(self) -> None:
        """End the step's saves (run even after a failed save_kv_layer: the connector may
        keep bookkeeping there); a raise fails the step's stores. In a step with
        synchronous loads the load errors are read first, and when a load failed the
        hook is not called: the step's stores fail (see the module)."""
        if self._has_plan and self._sync_loads and not self.loads_failed:
            self._early_errors = self._read_load_errors()
        if self._saves_poisoned():
            self.stores_failed = True
        elif self._has_plan:
            try:
                self.connector.wait_for_save()
            except Exception:  # noqa: BLE001 - containing it is the contract
                self._raised("wait_for_save", _STORES_FAIL)
                self.stores_failed = True

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished and failed transfers; empty on a raise (a connector keeps what it did
        not return and reports it next step; the guard passes the step's
        ``finished_req_ids`` again next time, so no delayed free is lost)."""
        finished = (self._unseen_finished | finished_req_ids if self._unseen_finished
                    else finished_req_ids)
        try:
            results = self.connector.get_transfer_results(finished)
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised("get_transfer_results", _NEXT_STEP)
            self._unseen_finished = set(finished)
            return KVConnectorTransferResults()
        if self._unseen_finished:
            self._unseen_finished = set()
        if not (results.finished_sending or results.finished_recving or results.failed_recving):
            return KVConnectorTransferResults()  # most steps: nothing to copy
        return KVConnectorTransferResults(
            finished_sending=set(results.finished_sending),
            finished_recving=set(results.finished_recving),
            failed_recving=set(results.failed_recving) & set(results.finished_recving),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed (with those read before ``wait_for_save``). On a raise
        this is unknown: the step's loads fail and :attr:`load_errors_unknown` is set."""
        errors = self._read_load_errors()
        if self._early_errors:
            errors |= self._early_errors
            self._early_errors = set()
        return errors

    def _read_load_errors(self) -> set[int]:
        try:
            return set(self.connector.get_block_ids_with_load_errors())
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised("get_block_ids_with_load_errors", "this step's loads count as failed")
            self.loads_failed = self.load_errors_unknown = True
            return set()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The step's stats; None on a raise."""
        try:
            stats = self.connector.get_kv_connector_stats()
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised("get_kv_connector_stats", "no stats this step")
            return None
        return stats if isinstance(stats, dict) and stats else None

    def get_kv_connector_kv_cache_events(self) -> list[Any]:
        """Worker-side events of connectors that define this optional vLLM hook; [] on a raise."""
        hook = self._events_hook
        if hook is None:
            return []
        try:
            events = hook()
            return list(events) if events else []
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised("get_kv_connector_kv_cache_events", "events lost")
            return []

    def build_connector_worker_meta(self) -> Any:
        """Records for the scheduler side; None on a raise (a connector keeps what it did
        not return and reports it next step)."""
        try:
            return self.connector.build_connector_worker_meta()
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised("build_connector_worker_meta", _NEXT_STEP)
            return None

    def clear_connector_metadata(self) -> None:
        """Unbind the plan; a raise is counted (the next bind replaces the plan)."""
        try:
            self.connector.clear_connector_metadata()
        except Exception:  # noqa: BLE001 - containing it is the contract
            self._raised("clear_connector_metadata", "the next bind replaces the plan")
            self._uncleared = True
        else:
            self._uncleared = False
        self._has_plan = False

    def shutdown(self) -> None:
        """Shut the connector down (not contained: the caller collects failures)."""
        self.connector.shutdown()
