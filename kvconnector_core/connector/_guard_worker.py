"""The guarded worker side; see :mod:`kvconnector_core.connector.guard` and
``docs/failure-contract.md``.

Per step the model runner calls, in order: :meth:`GuardedWorker.begin_step`, then the
hooks of the step (each a typed method), then :meth:`GuardedWorker.step_report` turns
what failed into the flags of the step's :class:`KVConnectorOutput`:

- ``loads_failed``: the step's loads may not have run or finished (``bind_connector_metadata``
  or ``start_load_kv`` raised). Sync loads' blocks are reported invalid by the runner;
  the scheduler reports the async loads it planned this step as failed receives and the
  scheduler side gets ``plan_failed(plan, loads_failed=True)``.
- ``stores_failed``: the step's stores may not have run or may have read blocks that
  changed (``bind_connector_metadata``, ``handle_preemptions``, ``save_kv_layer`` or
  ``wait_for_save`` raised); the scheduler side gets ``plan_failed(plan, stores_failed=True)``
  and must never make them visible.

Primitives: :class:`GuardedWorker`, :func:`count_error`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvconnector_core.connector.metadata import KVConnectorMetadata, KVConnectorTransferResults
from kvconnector_core.errors import ConnectorHookError

if TYPE_CHECKING:
    import torch

    from kvconnector_core.connector.base import KVConnectorBase_V1

__all__ = ["GuardedWorker", "count_error"]

logger = logging.getLogger("kvconnector_core.connector.guard")


def count_error(errors: dict[str, int], label: str, hook: str, consequence: str) -> None:
    """Log the exception being handled (naming the connector and hook) and count it."""
    logger.exception("connector %s raised in %s; %s", label, hook, consequence)
    errors[hook] = errors.get(hook, 0) + 1


class GuardedWorker:
    """A worker-side connector behind the failure contract; one typed method per hook.

    Args:
        connector: the worker-role connector.
        label: names the connector in log lines and errors (default: its ``name``).
        errors: the dict to count errors in (hook name -> count); default: a new one.
    """

    def __init__(self, connector: KVConnectorBase_V1, *, label: str | None = None,
                 errors: dict[str, int] | None = None) -> None:
        self.connector = connector
        self.label = label or connector.name
        self.errors: dict[str, int] = {} if errors is None else errors
        """Per hook name, how many times the connector raised (contained)."""
        self.loads_failed = False
        """This step's loads may not have run (reset by :meth:`begin_step`)."""
        self.stores_failed = False
        """This step's stores may not have run or read changed blocks (reset each step)."""
        self.load_errors_unknown = False
        """``get_block_ids_with_load_errors`` raised this step: which loads failed is unknown."""
        self._has_plan = False

    def __repr__(self) -> str:
        return f"<GuardedWorker {self.label}>"

    @property
    def has_sync_kv_loads(self) -> bool:
        """The connector's capability (read on the instance)."""
        return bool(self.connector.has_sync_kv_loads)

    def _failed(self, hook: str, consequence: str) -> None:
        count_error(self.errors, self.label, hook, consequence)

    def begin_step(self) -> None:
        """Reset the per-step failure flags."""
        self.loads_failed = self.stores_failed = self.load_errors_unknown = False
        self._has_plan = False

    # ------------------------------------------------------------------ hooks

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Give the connector the KV tensors; not contained (a startup error).

        Raises:
            ConnectorHookError: the hook raised (the original is the cause).
        """
        try:
            self.connector.register_kv_caches(kv_caches)
        except Exception as exc:
            msg = f"connector {self.label} raised in register_kv_caches: {type(exc).__name__}: {exc}"
            raise ConnectorHookError(msg, self.label, "register_kv_caches") from exc

    def bind_connector_metadata(self, plan: KVConnectorMetadata) -> bool:
        """Bind the step's plan; False when it raised (the whole plan failed: the step's
        loads and stores are skipped and reported failed)."""
        try:
            self.connector.bind_connector_metadata(plan)
        except Exception:  # noqa: BLE001 - contained by contract
            self._failed("bind_connector_metadata", "the step's loads and stores fail")
            self.loads_failed = self.stores_failed = True
            return False
        self._has_plan = True
        return True

    def handle_preemptions(self, plan: KVConnectorMetadata) -> None:
        """Let the connector flush preempted requests' stores (called even when the bind
        failed: the plan is the argument). A raise fails the step's stores."""
        try:
            self.connector.handle_preemptions(plan)
        except Exception:  # noqa: BLE001 - contained by contract
            self._failed("handle_preemptions", "the step's stores fail")
            self.stores_failed = True

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Start the step's loads; skipped without a bound plan. A raise fails them."""
        if not self._has_plan:
            return
        try:
            self.connector.start_load_kv(forward_context)
        except Exception:  # noqa: BLE001 - contained by contract
            self._failed("start_load_kv", "the step's loads fail")
            self.loads_failed = True

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for one layer's loads; a raise fails the step's loads."""
        if not self._has_plan or self.loads_failed:
            return
        try:
            self.connector.wait_for_layer_load(layer_name)
        except Exception:  # noqa: BLE001 - contained by contract
            self._failed("wait_for_layer_load", "the step's loads fail")
            self.loads_failed = True

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        """Save one layer; a raise fails the step's stores (later layers are not saved)."""
        if not self._has_plan or self.stores_failed:
            return
        try:
            self.connector.save_kv_layer(layer_name, kv_layer, attn_metadata)
        except Exception:  # noqa: BLE001 - contained by contract
            self._failed("save_kv_layer", "the step's stores fail")
            self.stores_failed = True

    def wait_for_save(self) -> None:
        """End the step's saves (run even after a failed save_kv_layer: the connector may
        keep bookkeeping there); a raise fails the step's stores."""
        if not self._has_plan:
            return
        try:
            self.connector.wait_for_save()
        except Exception:  # noqa: BLE001 - contained by contract
            self._failed("wait_for_save", "the step's stores fail")
            self.stores_failed = True

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished and failed transfers; empty on a raise (a connector keeps what it did
        not return and reports it next step)."""
        try:
            results = self.connector.get_transfer_results(finished_req_ids)
        except Exception:  # noqa: BLE001 - contained by contract
            self._failed("get_transfer_results", "reported next step")
            return KVConnectorTransferResults()
        return KVConnectorTransferResults(
            finished_sending=set(results.finished_sending),
            finished_recving=set(results.finished_recving),
            failed_recving=set(results.failed_recving) & set(results.finished_recving),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed. On a raise this is unknown: the step's sync loads fail
        (``loads_failed``) and :attr:`load_errors_unknown` tells the runner to report
        every receive finished this step as failed."""
        try:
            return set(self.connector.get_block_ids_with_load_errors())
        except Exception:  # noqa: BLE001 - contained by contract
            self._failed("get_block_ids_with_load_errors", "this step's loads count as failed")
            self.loads_failed = self.load_errors_unknown = True
            return set()

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The step's stats; None on a raise."""
        try:
            stats = self.connector.get_kv_connector_stats()
        except Exception:  # noqa: BLE001 - stats are informational
            self._failed("get_kv_connector_stats", "no stats this step")
            return None
        return stats if isinstance(stats, dict) and stats else None

    def get_kv_connector_kv_cache_events(self) -> list[Any]:
        """Worker-side events of connectors that define this optional vLLM hook; [] on a raise."""
        hook = getattr(self.connector, "get_kv_connector_kv_cache_events", None)  # not on the base
        if hook is None:
            return []
        try:
            return list(hook() or ())
        except Exception:  # noqa: BLE001 - contained by contract
            self._failed("get_kv_connector_kv_cache_events", "events lost")
            return []

    def build_connector_worker_meta(self) -> Any:
        """Records for the scheduler side; None on a raise (a connector keeps what it did
        not return and reports it next step)."""
        try:
            return self.connector.build_connector_worker_meta()
        except Exception:  # noqa: BLE001 - contained by contract
            self._failed("build_connector_worker_meta", "reported next step")
            return None

    def clear_connector_metadata(self) -> None:
        """Unbind the plan; a raise is counted (the next bind replaces the plan)."""
        try:
            self.connector.clear_connector_metadata()
        except Exception:  # noqa: BLE001 - contained by contract
            self._failed("clear_connector_metadata", "the next bind replaces the plan")
        self._has_plan = False

    def shutdown(self) -> None:
        """Shut the connector down (not contained: the caller collects failures)."""
        self.connector.shutdown()
