"""Fault injection: wrap a connector so that loads and stores fail, hooks raise, and
completions arrive late.

:class:`FaultInjectingConnector` wraps one side of a connector; build one wrapper per side
with the same settings (:class:`~kvconnector_core.testing.fault_settings.FaultSettings`).
Faults are drawn from RNGs seeded with ``seed`` (:class:`FaultDice`), so a run is
reproducible. To inject faults into an engine (or into one child of a MultiConnector) from a
config, wrap the connector's config with :func:`fault_injection_config`.

- **Load failures** (``load_failure_rate``): the scheduler-side wrapper decides, per load
  the inner connector plans (``update_state_after_alloc`` with external tokens), whether it
  fails, and tells the worker-side wrapper in its metadata. The worker-side wrapper reports
  the load's blocks in ``get_block_ids_with_load_errors`` and, for an asynchronous load,
  the request as a failed receive (in ``finished_recving`` and ``failed_recving``), exactly
  as a connector whose transfer failed must. The inner connector still runs, so its data is
  ignored, never trusted.
- **Store failures** (``store_failure_rate``): per step, the scheduler-side wrapper decides
  whether the step's stores fail. The worker-side wrapper then raises
  :class:`InjectedFault` from ``wait_for_save`` (after the inner connector ran, so its
  bookkeeping of queued jobs and delayed frees stays whole): by the failure contract a
  raising save hook is a failed store, which must never become visible. The kit checks
  that: the scheduler-side wrapper records the hashes of the blocks a failed step completed
  (:class:`FailedStoreLedger`) and, when a later lookup (``get_num_new_matched_tokens``)
  claims one of them, records a
  :class:`~kvconnector_core.testing.fault_settings.FailedStoreHit` in
  :attr:`FaultInjectingConnector.failed_store_hits` (call
  :meth:`FaultInjectingConnector.check_failed_stores_invisible` to assert there are none).
  A hash that a later step without store failure completes again counts as stored.
- **Raising hooks** (``raise_in``): any hook of either role raises :class:`InjectedFault`
  instead of reaching the inner connector: on every call, at a rate per call, or once at
  a given step (:class:`~kvconnector_core.testing.fault_settings.HookFault`).
- **Late completions** (``completion_delay_steps``): each finished send or receive is
  reported up to that many steps late (a random delay per request, so also out of order);
  a failed load's block errors travel with its late receive.

``get_kv_connector_stats`` adds ``injected_faults`` (counts by kind) to the inner stats.

Primitives: :class:`FaultInjectingConnector`, :class:`FaultInjector`,
:func:`fault_injection_config`, :class:`FaultMetadata`, :class:`InjectedFault`,
:class:`FaultDice`, :class:`FailedStoreLedger`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from kvconnector_core.connector.base import KVConnectorBase_V1, KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorTransferResults,
    decode_metadata,
    encode_metadata,
)
from kvconnector_core.errors import ConfigError, TransferError
from kvconnector_core.testing.fault_settings import (
    FAULT_HOOKS,
    FailedStoreHit,
    FaultSettings,
    HookFault,
    hook_faults,
)

if TYPE_CHECKING:
    import torch

    from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheBlocks
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
    from kvconnector_core.kv_events import KVCacheEvent
    from kvconnector_core.request import Request
    from kvconnector_core.scheduler.output import SchedulerOutput

__all__ = [
    "FAULT_HOOKS",
    "FailedStoreLedger",
    "FaultDice",
    "FaultInjectingConnector",
    "FaultInjector",
    "FaultMetadata",
    "InjectedFault",
    "fault_injection_config",
]

# Steps whose completed blocks are remembered, so a plan reported failed later
# (``plan_failed``) can mark its stores failed.
_REMEMBERED_STEPS = 32

class InjectedFault(TransferError):  # noqa: N818 - a public name; "fault" already says what it is
    """Raised by a :class:`FaultInjectingConnector` hook on purpose."""


class FaultMetadata(KVConnectorMetadata, kw_only=True):
    """The wrapper's plan: the inner plan plus the faults drawn for this step.

    Attributes:
        inner: the inner connector's metadata, msgpack-encoded.
        failed_loads: request id -> (block ids, is_async) of loads that fail.
        fail_stores: whether this step's stores fail.
        step: the scheduler-side step that built the plan.
    """

    inner: msgspec.Raw
    failed_loads: dict[str, tuple[list[int], bool]] = msgspec.field(default_factory=dict)
    fail_stores: bool = False
    step: int = 0


class FaultDice:
    """Decides, from the settings and seeded RNGs, which faults a wrapper injects.

    Separate streams for loads and stores, raises, and delays, so that adding a raising
    hook or a delay leaves the load/store pattern of a seed unchanged. The rates are the
    caller's, per draw (a test may change a wrapper's rates between steps).

    Args:
        settings: the seed and the raising hooks.
    """

    def __init__(self, settings: FaultSettings) -> None:
        self.hook_faults: dict[str, HookFault] = {f.hook: f for f in settings.raise_in}
        """Hook name -> when it raises (:meth:`arm` replaces one)."""
        self._rng = random.Random(settings.seed)
        self._raise_rng = random.Random(f"{settings.seed}:raise")
        self._delay_rng = random.Random(f"{settings.seed}:delay")
        self._raised_once: set[str] = set()

    def arm(self, fault: HookFault) -> None:
        """Make ``fault.hook`` raise as ``fault`` says, replacing what it did before."""
        self.hook_faults[fault.hook] = fault
        self._raised_once.discard(fault.hook)

    def hook_raises(self, hook: str, step: int) -> bool:
        """Whether this call of ``hook``, in ``step``, raises."""
        fault = self.hook_faults.get(hook)
        if fault is None:
            return False
        if fault.at_step is not None:
            if hook in self._raised_once or step < fault.at_step:
                return False
            self._raised_once.add(hook)
            return True
        return fault.rate >= 1.0 or self._raise_rng.random() < fault.rate

    def load_fails(self, rate: float) -> bool:
        """Whether a load the inner connector planned fails, at ``rate``."""
        return self._rng.random() < rate

    def stores_fail(self, rate: float) -> bool:
        """Whether a step's stores fail, at ``rate``."""
        return rate > 0 and self._rng.random() < rate

    def completion_delay(self, most: int) -> int:
        """How many steps late (up to ``most``) a finished transfer is reported."""
        return self._delay_rng.randint(0, most) if most else 0


class FailedStoreLedger:
    """Which block hashes only failed stores covered, so a lookup claiming one is caught.

    A failed step's stores are taken to be the blocks it completes; a good step may store
    any full block of the requests it schedules (a connector may store blocks it could not
    store earlier, or a prefix it missed), so all of them count as stored. Erring this way
    a failed store can go unnoticed, but a good one is never reported.
    """

    def __init__(self) -> None:
        self._failed: set[bytes] = set()
        self._good: set[bytes] = set()
        self._by_step: dict[int, set[bytes]] = {}  # step -> hashes first marked stored by it

    def has_failed(self) -> bool:
        """Whether any hash is a failed store now."""
        return bool(self._failed)

    def failed_positions(self, first: int, hashes: Iterable[bytes]) -> tuple[int, ...]:
        """The positions (counting from ``first``) of ``hashes`` that are failed stores."""
        return tuple(first + i for i, h in enumerate(hashes) if bytes(h) in self._failed)

    def record_step(self, step: int, completed: set[bytes], *, failed: bool) -> None:
        """Record the hashes ``step`` stored (or failed to store)."""
        self._by_step[step] = set() if failed else completed - self._good
        self._by_step.pop(step - _REMEMBERED_STEPS, None)
        self._mark(completed, failed=failed)

    def fail_step(self, step: int) -> None:
        """The blocks ``step`` stored first are failed stores after all (blocks stored by
        an earlier step stay stored)."""
        hashes = self._by_step.pop(step, set())
        self._good -= hashes
        self._mark(hashes, failed=True)

    def _mark(self, hashes: set[bytes], *, failed: bool) -> None:
        if failed:
            self._failed |= hashes - self._good
        else:
            self._good |= hashes
            self._failed -= hashes


class FaultInjectingConnector(KVConnectorBase_V1):
    """Wraps one side of a connector and injects faults; see the module docstring.

    Every hook of either role forwards to the inner connector, unless a fault is drawn
    for it; the wrapper only ever runs the hooks of its inner connector's role.

    Args:
        inner: the connector (one side) to wrap.
        load_failure_rate: see :class:`FaultSettings`.
        store_failure_rate: see :class:`FaultSettings`.
        raise_in: hooks that raise: names (every call), ``{name: rate}`` or
            :class:`HookFault` records.
        completion_delay_steps: see :class:`FaultSettings`.
        seed: seed of the fault RNGs.

    Raises:
        ConfigError: a rate outside [0, 1], an unknown hook name, a negative delay.
    """

    name: ClassVar[str] = "FaultInjectingConnector"
    metadata_type: ClassVar[type[KVConnectorMetadata]] = FaultMetadata

    def __init__(
        self,
        inner: KVConnectorBase_V1,
        *,
        load_failure_rate: float = 0.0,
        store_failure_rate: float = 0.0,
        raise_in: Iterable[str | HookFault] | Mapping[str, float] = (),
        completion_delay_steps: int = 0,
        seed: int = 0,
    ) -> None:
        # Before the base checks it: the wrapper handles the groups its inner connector handles.
        self.supports_multiple_kv_cache_groups = (  # type: ignore[misc]  # ClassVar per instance
            inner.supports_multiple_kv_cache_groups)
        super().__init__(inner.config, inner.role, inner.kv_cache_config)
        # Not ``settings``: the base class's name for a connector's typed extra_config.
        self.fault_settings = FaultSettings(
            load_failure_rate=load_failure_rate, store_failure_rate=store_failure_rate,
            raise_in=hook_faults(raise_in), completion_delay_steps=completion_delay_steps,
            seed=seed)
        self.inner = inner
        self.load_failure_rate = load_failure_rate
        """The rate of load failures; a test may change it between steps."""
        self.store_failure_rate = store_failure_rate
        """The rate of store failures; a test may change it between steps."""
        self.dice = FaultDice(self.fault_settings)
        """Draws the faults."""
        self.raise_in = frozenset(self.dice.hook_faults)
        # The wrapper's capability ClassVars are per instance: it mirrors what it wraps.
        self.supports_async_load = inner.supports_async_load  # type: ignore[misc]
        self.has_sync_kv_loads = inner.has_sync_kv_loads  # type: ignore[misc]
        self.requires_block_pool = inner.requires_block_pool  # type: ignore[misc]
        self._step = 0  # plans built (scheduler side) or bound (worker side)
        # scheduler side
        self._requests: dict[str, Request] = {}
        self._lookups: dict[str, tuple[int, bool]] = {}  # req -> (local hit, async)
        self._step_failed: dict[str, tuple[list[int], bool]] = {}
        self._ledger = FailedStoreLedger()
        self.failed_store_hits: list[FailedStoreHit] = []
        """Lookups that claimed blocks whose stores failed (should stay empty)."""
        # worker side
        self._invalid: set[int] = set()
        self._async_invalid: dict[str, list[int]] = {}
        self._failed_recv: set[str] = set()
        self._suppressed_recv: set[str] = set()
        self._late: list[tuple[int, str, str, bool]] = []  # (due step, "send"/"recv", req, failed)
        self._fail_stores = False
        self._stats_reported: dict[str, int] = {}
        self.num_injected = {"loads": 0, "stores": 0, "raises": 0, "late": 0}
        """How many faults were injected, by kind."""
        self.num_injected_raises = 0
        """How many times a hook raised InjectedFault on purpose (failed stores included,
        which raise from ``wait_for_save``); the engine's guard counts each one as an error."""

    def __repr__(self) -> str:
        return f"<FaultInjectingConnector inner={self.inner!r}>"

    def arm_hook_fault(self, fault: HookFault) -> None:
        """Make ``fault.hook`` raise as ``fault`` says from now on (e.g. once, at a step
        computed while the engine runs), replacing its fault so far."""
        self.dice.arm(fault)

    @property
    def step(self) -> int:
        """Plans built so far (scheduler side) or bound so far (worker side)."""
        return self._step

    def _maybe_raise(self, hook: str) -> None:
        if not self.dice.hook_raises(hook, self._step):
            return
        self.num_injected["raises"] += 1
        self.num_injected_raises += 1
        msg = f"injected fault in {self.inner.name}.{hook} (step {self._step})"
        raise InjectedFault(msg)

    def _block_size(self) -> int | None:
        try:
            # A missing config (None) is one of the cases the except below handles.
            groups = self._kv_cache_config.kv_cache_groups  # type: ignore[union-attr]
            return int(groups[0].kv_cache_spec.block_size)
        except (AttributeError, IndexError, TypeError):
            return None

    # ------------------------------------------------------------ scheduler side

    def bind_gpu_block_pool(self, gpu_block_pool: GPUBlockPoolView) -> None:
        """Forward (or raise)."""
        self._maybe_raise("bind_gpu_block_pool")
        self.inner.bind_gpu_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Forward (or raise); record a claim of a block whose store failed."""
        self._requests[request.request_id] = request
        self._maybe_raise("get_num_new_matched_tokens")
        hit = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        self._lookups[request.request_id] = (num_computed_tokens, bool(hit[1]))
        block_size = self._block_size()
        if hit[0] and block_size and self._ledger.has_failed():
            first = num_computed_tokens // block_size
            claimed = request.block_hashes[first:(num_computed_tokens + hit[0]) // block_size]
            bad = self._ledger.failed_positions(first, claimed)
            if bad:
                self.failed_store_hits.append(FailedStoreHit(request.request_id, self._step, bad))
        return hit

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Forward (or raise); draw whether a planned load fails."""
        self._requests[request.request_id] = request
        self._maybe_raise("update_state_after_alloc")
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
        if num_external_tokens > 0 and self.dice.load_fails(self.load_failure_rate):
            self.num_injected["loads"] += 1
            ids = list(blocks.get_block_ids()[0])
            local, is_async = self._lookups.get(request.request_id, (0, False))
            block_size = self._block_size()
            if block_size:  # only the blocks the load writes; else all (a superset is safe)
                ids = ids[local // block_size: -(-(local + num_external_tokens) // block_size)]
            self._step_failed[request.request_id] = (ids, is_async)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> FaultMetadata:
        """Wrap the inner plan with this step's faults (or raise)."""
        fail_stores = self.dice.stores_fail(self.store_failure_rate)
        step = self._step
        self._note_completed_blocks(scheduler_output, step, failed=fail_stores)
        try:
            self._maybe_raise("build_connector_meta")
            inner = self.inner.build_connector_meta(scheduler_output)
        finally:
            self._step += 1
        meta = FaultMetadata(inner=msgspec.Raw(encode_metadata(inner)),
                             failed_loads=self._step_failed, fail_stores=fail_stores, step=step)
        self._step_failed = {}
        return meta

    def _note_completed_blocks(self, scheduler_output: SchedulerOutput, step: int, *,
                               failed: bool) -> None:
        """Tell the ledger which block hashes this step's stores cover (see
        :class:`FailedStoreLedger`)."""
        block_size = self._block_size()
        if not block_size:
            return
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        completed: set[bytes] = set()
        for rid, done_before in computed.items():
            request = self._requests.get(rid)
            if request is None:
                continue
            done = done_before + scheduler_output.num_scheduled_tokens.get(rid, 0)
            first = done_before // block_size if failed else 0
            completed |= {bytes(h) for h in request.block_hashes[first:done // block_size]}
        self._ledger.record_step(step, completed, failed=failed)

    def check_failed_stores_invisible(self) -> None:
        """Assert that no lookup claimed a block whose store failed.

        Raises:
            AssertionError: naming the first such lookups.
        """
        if self.failed_store_hits:
            msg = (f"{self.inner.name}: {len(self.failed_store_hits)} lookups claimed blocks "
                   f"whose stores failed; first: {self.failed_store_hits[:3]}")
            raise AssertionError(msg)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forward (or raise)."""
        self._maybe_raise("update_connector_output")
        self.inner.update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forward (or raise)."""
        self._lookups.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        self._maybe_raise("request_finished")
        return self.inner.request_finished(request, block_ids)

    def forget_requests(self, request_ids: set[str]) -> None:
        """Forward (or raise)."""
        self._maybe_raise("forget_requests")
        self.inner.forget_requests(request_ids)

    def plan_failed(self, connector_metadata: KVConnectorMetadata, *, loads_failed: bool,
                    stores_failed: bool) -> None:
        """Forward the inner plan (or raise); a plan whose stores failed makes them failed
        stores."""
        if not isinstance(connector_metadata, FaultMetadata):
            return
        if stores_failed:
            self._ledger.fail_step(connector_metadata.step)
        self._maybe_raise("plan_failed")
        inner = decode_metadata(connector_metadata.inner, self.inner.metadata_type)
        self.inner.plan_failed(inner, loads_failed=loads_failed, stores_failed=stores_failed)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Forward; a raise comes after draining the inner events, so they are lost."""
        events = list(self.inner.take_events())
        self._maybe_raise("take_events")
        return events

    def get_event_snapshot(self) -> Iterable[KVCacheEvent]:
        """Forward (or raise) the inner connector's event snapshot, where it has one."""
        self._maybe_raise("get_event_snapshot")
        snapshot = getattr(self.inner, "get_event_snapshot", None)
        return snapshot() if snapshot is not None else ()

    # --------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Forward (or raise)."""
        self._maybe_raise("register_kv_caches")
        self.inner.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Note the step's faults, then bind the inner plan (or raise)."""
        if not isinstance(connector_metadata, FaultMetadata):
            msg = (f"FaultInjectingConnector expected FaultMetadata, got "
                   f"{type(connector_metadata).__qualname__}")
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
        self.inner.bind_connector_metadata(
            decode_metadata(connector_metadata.inner, self.inner.metadata_type))

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Forward (or raise)."""
        self._maybe_raise("start_load_kv")
        self.inner.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Forward (or raise)."""
        self._maybe_raise("wait_for_layer_load")
        self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any = None) -> None:
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
            self.inner.handle_preemptions(
                decode_metadata(connector_metadata.inner, self.inner.metadata_type))

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
        now: list[tuple[str, str, bool]] = [
            ("send", r, False) for r in sorted(res.finished_sending)]
        now += [("recv", r, r in failed) for r in sorted(recving | self._failed_recv)]
        self._failed_recv = set()
        most = self.fault_settings.completion_delay_steps
        for kind, req_id, is_failed in now:
            delay = self.dice.completion_delay(most)
            self.num_injected["late"] += delay > 0
            self._late.append((self._step + delay, kind, req_id, is_failed))
        return self._due_completions()

    def _due_completions(self) -> KVConnectorTransferResults:
        """Take the completions due by this step out of the late queue."""
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
        errors = self._invalid | set(self.inner.get_block_ids_with_load_errors())
        self._invalid = set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, Any] | None:
        """The inner stats plus ``injected_faults`` (and ``failed_stores_visible``), both as
        counts since the previous call."""
        self._maybe_raise("get_kv_connector_stats")
        stats = dict(self.inner.get_kv_connector_stats() or {})
        # Deltas since the last call, as the engine sums stats over steps (totals would be
        # counted again every step); ``num_injected`` keeps the totals.
        now = {**self.num_injected, "failed_stores_visible": len(self.failed_store_hits)}
        seen, self._stats_reported = self._stats_reported, now
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

    def reset_cache(self) -> bool | None:
        """Forward (or raise): the engine is about to reset its GPU prefix cache."""
        self._maybe_raise("reset_cache")
        return self.inner.reset_cache()

    def get_kv_connector_kv_cache_events(self) -> Any:
        """Forward the inner worker's events (vLLM's optional hook), None without it."""
        hook = getattr(self.inner, "get_kv_connector_kv_cache_events", None)
        return hook() if hook is not None else None

    def has_pending_work(self) -> bool:
        """Forward (no fault is injected: it only decides whether the engine idles)."""
        hook = getattr(self.inner, "has_pending_work", None)
        return bool(hook()) if hook is not None else False

    def shutdown(self) -> None:
        """Forward (or raise)."""
        self._maybe_raise("shutdown")
        self.inner.shutdown()


class FaultInjector(FaultInjectingConnector):
    """A :class:`FaultInjectingConnector` built from a connector config (see
    :func:`fault_injection_config`): ``extra_config`` holds ``inner`` (the wrapped
    connector's config, a dict) and the fields of :class:`FaultSettings`.

    Raises:
        ConfigError: invalid settings or inner config; RegistryError: unknown inner name.
    """

    name: ClassVar[str] = "FaultInjector"

    def __init__(self, config: KVConnectorConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        from kvconnector_core.plugins.registry import create_connector

        extra = dict(config.extra_config)
        if "inner" not in extra:
            msg = "FaultInjector needs extra_config['inner'], the config of the connector to wrap"
            raise ConfigError(msg)
        inner_config = _inner_config(extra.pop("inner"), config)
        inner = create_connector(inner_config, role, kv_cache_config)
        s = FaultSettings.from_dict(extra)
        super().__init__(inner, load_failure_rate=s.load_failure_rate,
                         store_failure_rate=s.store_failure_rate, raise_in=s.raise_in,
                         completion_delay_steps=s.completion_delay_steps, seed=s.seed)


def _inner_config(inner: KVConnectorConfig | Mapping[str, Any],
                  outer: KVConnectorConfig) -> KVConnectorConfig:
    """The wrapped connector's config, with the engine's fields of the wrapper's config.

    :func:`fault_injection_config` copies those fields from the inner config to the
    wrapper's, so they stay the inner config's own unless the engine set others on the
    wrapper (vLLM's adapter sets the worker count and each worker's rank): the wrapped
    connector must run as the worker the engine built, or its workers share one rank's
    secondary-tier keys and load each other's shards.
    """
    fields = inner.to_dict() if isinstance(inner, KVConnectorConfig) else dict(inner)
    return KVConnectorConfig.from_dict({**fields, **outer.engine_fields()})


def fault_injection_config(inner: KVConnectorConfig | Mapping[str, Any],
                           settings: FaultSettings | None = None) -> KVConnectorConfig:
    """A connector config that creates ``inner`` wrapped in a :class:`FaultInjector`.

    Use it wherever a config goes: ``EngineConfig(connector=...)`` or a child of a
    MultiConnector. The fields an engine sets (role, load-failure policy, KV events, world
    size, rank, pipeline stages) are the inner config's; an engine that sets them on the
    wrapper (vLLM's adapter, for each worker) sets them on the wrapped connector too.

    Args:
        inner: the wrapped connector's config.
        settings: the faults (default: none).

    Returns:
        The wrapping config.
    """
    inner_cfg = KVConnectorConfig.from_dict(dict(inner) if isinstance(inner, Mapping) else inner)
    extra = {"inner": inner_cfg.to_dict(), **msgspec.to_builtins(settings or FaultSettings())}
    return KVConnectorConfig(name=FaultInjector.name, module_path=__name__, extra_config=extra,
                             **inner_cfg.engine_fields())
