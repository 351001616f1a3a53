"""The guarded worker side; see :mod:`kvconnector_core.connector.guard` and
``docs/failure-contract.md``.

Per step the model runner calls :meth:`GuardedWorker.begin_step`, then the hooks of the
step (each a typed method); what failed is left in three flags that the runner puts into
the step's :class:`KVConnectorOutput`:

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

Primitives: :class:`GuardedWorker`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvconnector_core.connector._guard_base import GuardBase
from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorTransferResults

if TYPE_CHECKING:
    import torch

    from kvconnector_core.connector.base import KVConnectorBase_V1

__all__ = ["GuardedWorker"]

_LOADS_FAIL = "the step's loads fail"
_STORES_FAIL = "the step's stores fail"
_NEXT_STEP = "the connector reports it next step"


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
        self._skip_saves = False  # the engine says this step computes on a failed load
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

    def begin_step(self, *, sync_loads: bool = True, skip_saves: bool = False) -> None:
        """Reset the per-step failure flags; a quarantined connector's loads and stores
        fail every step (the scheduler recomputes and drops them).

        Args:
            sync_loads: whether the step may have synchronous loads (the forward then
                reads blocks being loaded, and a failed load fails the step's stores);
                True when unknown.
            skip_saves: the engine knows this step computes on a failed load already
                (vLLM's async scheduling runs a step planned before an earlier step's
                failure was known): no save hook is called and the stores fail.
        """
        self.loads_failed = self.stores_failed = self.quarantined
        self._sync_loads = sync_loads
        self._skip_saves = skip_saves
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
        self._not_contained("register_kv_caches", lambda: self.connector.register_kv_caches(kv_caches))

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

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        """Save one layer; a raise fails the step's stores (later layers are not saved).
        Skipped once a synchronous load of the step failed (the layer holds KV computed
        on it)."""
        if self._skip_saves or (self.loads_failed and self._sync_loads):
            self.stores_failed = True
        elif self._has_plan and not self.stores_failed:
            try:
                self.connector.save_kv_layer(layer_name, kv_layer, attn_metadata)
            except Exception:  # noqa: BLE001 - containing it is the contract
                self._raised("save_kv_layer", _STORES_FAIL)
                self.stores_failed = True

    def _saves_poisoned(self) -> bool:
        """A synchronous load of this step failed, so what the step computed is wrong."""
        return self._skip_saves or (
            self._sync_loads and (self.loads_failed or bool(self._early_errors)))

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
        finished = self._unseen_finished | finished_req_ids if self._unseen_finished else finished_req_ids
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
