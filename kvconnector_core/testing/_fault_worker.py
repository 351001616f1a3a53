"""The fault injector's worker-side hooks: failed loads reported, failed stores raised,
completions delayed (see :mod:`kvconnector_core.testing.faults`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvconnector_core.connector.base import KVConnectorRole
from kvconnector_core.connector.metadata import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
    decode_metadata,
)
from kvconnector_core.errors import ConfigError
from kvconnector_core.testing._fault_base import FaultMetadata, InjectedFault, _FaultBase

if TYPE_CHECKING:
    import torch


class _WorkerFaults(_FaultBase):
    """The worker-side hooks of ``FaultInjectingConnector``."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Forward (or raise)."""
        self._maybe_raise("register_kv_caches")
        self.inner.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Note the step's faults, then bind the inner plan (or raise)."""
        if not isinstance(connector_metadata, FaultMetadata):
            msg = f"FaultInjectingConnector expected FaultMetadata, got {type(connector_metadata).__qualname__}"
            raise ConfigError(msg)
        super().bind_connector_metadata(connector_metadata)
        self._step += 1
        for req_id, (ids, is_async) in connector_metadata.failed_loads.items():
            if is_async:
                self._failed_recv.add(req_id)
                self._suppressed_recv.add(req_id)
                self._async_invalid[req_id] = ids
            else:
                self._invalid.update(ids)
        self._fail_stores = connector_metadata.fail_stores
        if self._fail_stores:
            self.num_injected["stores"] += 1
        self._maybe_raise("bind_connector_metadata")
        self.inner.bind_connector_metadata(decode_metadata(connector_metadata.inner, self.inner.metadata_type))

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Forward (or raise)."""
        self._maybe_raise("start_load_kv")
        self.inner.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Forward (or raise)."""
        self._maybe_raise("wait_for_layer_load")
        self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        """Forward (or raise)."""
        self._maybe_raise("save_kv_layer")
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        """Forward; when this step's stores fail, raise InjectedFault afterwards.

        The inner connector still runs its bookkeeping (queued jobs, delayed frees):
        skipping it would leave requests it holds blocks for unreleased forever. The
        raise is what makes the stores failed ones under the failure contract.
        """
        self._maybe_raise("wait_for_save")
        self.inner.wait_for_save()
        if self._fail_stores:
            self.num_injected_raises += 1
            msg = f"injected store failure in {self.inner.name} (step {self._step})"
            raise InjectedFault(msg)

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:
        """Forward the inner plan (or raise), so preempted requests' stores are flushed."""
        self._maybe_raise("handle_preemptions")
        if isinstance(connector_metadata, FaultMetadata):
            self.inner.handle_preemptions(decode_metadata(connector_metadata.inner, self.inner.metadata_type))

    def build_connector_worker_meta(self) -> Any:
        """Forward (or raise): the inner connector's job completions travel here."""
        self._maybe_raise("build_connector_worker_meta")
        return self.inner.build_connector_worker_meta()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The inner results, failed loads reported as failed receives, some of them late."""
        self._maybe_raise("get_transfer_results")
        res = self.inner.get_transfer_results(finished_req_ids)
        recving = {r for r in res.finished_recving if r not in self._suppressed_recv}
        self._suppressed_recv -= res.finished_recving
        failed = (set(res.failed_recving) & recving) | self._failed_recv
        now: list[tuple[str, str, bool]] = [("send", r, False) for r in sorted(res.finished_sending)]
        now += [("recv", r, r in failed) for r in sorted(recving | self._failed_recv)]
        self._failed_recv = set()
        delay = self.fault_settings.completion_delay_steps
        for kind, req_id, is_failed in now:
            d = self._delay_rng.randint(0, delay) if delay else 0
            self.num_injected["late"] += d > 0
            self._late.append((self._step + d, kind, req_id, is_failed))
        out = KVConnectorTransferResults()
        keep = []
        for due, kind, req_id, is_failed in self._late:
            if due > self._step:
                keep.append((due, kind, req_id, is_failed))
            elif kind == "send":
                out.finished_sending.add(req_id)
            else:
                out.finished_recving.add(req_id)
                if is_failed:
                    out.failed_recving.add(req_id)
                self._invalid.update(self._async_invalid.pop(req_id, ()))
        self._late = keep
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Legacy form of :meth:`get_transfer_results`."""
        self._maybe_raise("get_finished")
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The inner errors plus the injected failed loads' blocks."""
        self._maybe_raise("get_block_ids_with_load_errors")
        errors, self._invalid = self._invalid | set(self.inner.get_block_ids_with_load_errors()), set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The inner stats plus ``injected_faults`` (and ``failed_stores_visible``), both as
        counts since the previous call."""
        self._maybe_raise("get_kv_connector_stats")
        stats = dict(self.inner.get_kv_connector_stats() or {})
        # Deltas since the last call, as the engine sums stats over steps (totals would be
        # counted again every step); ``num_injected`` keeps the totals.
        now = {**self.num_injected, "failed_stores_visible": len(self.failed_store_hits)}
        seen = getattr(self, "_stats_reported", {})
        self._stats_reported = now
        delta = {k: v - seen.get(k, 0) for k, v in now.items()}
        stats["injected_faults"] = {k: delta[k] for k in self.num_injected}
        if self.role == KVConnectorRole.SCHEDULER:
            stats["failed_stores_visible"] = delta["failed_stores_visible"]
        return stats

    def clear_connector_metadata(self) -> None:
        """Unbind both plans (or raise)."""
        self._fail_stores = False
        self._maybe_raise("clear_connector_metadata")
        self.inner.clear_connector_metadata()
        super().clear_connector_metadata()

    def has_pending_work(self) -> bool:
        """Forward (no fault is injected: it only decides whether the engine idles)."""
        hook = getattr(self.inner, "has_pending_work", None)
        return bool(hook()) if hook is not None else False

    def shutdown(self) -> None:
        """Forward (or raise)."""
        self._maybe_raise("shutdown")
        self.inner.shutdown()
