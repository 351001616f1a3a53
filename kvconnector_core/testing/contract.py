"""``ConnectorContract``: the tests every connector, built-in or third-party, must pass.

Subclass it in a test module and set ``connector_config``::

    from kvconnector_core.connector import KVConnectorConfig
    from kvconnector_core.testing import ConnectorContract

    class TestMyConnectorContract(ConnectorContract):
        connector_config = KVConnectorConfig(name="MyConnector", extra_config={...})

pytest collects the inherited ``test_*`` methods. Override :meth:`make_connector`
to build the connector differently (e.g. inject a clock), and ``registry`` to
resolve the name in a registry of your own (default: the installed plugins).
The tests drive real core objects (block pool, KV cache manager, requests) and
never need a GPU.

Primitives: :class:`ConnectorContract`.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, ClassVar

from kvconnector_core.connector.base import ABSTRACT_HOOKS, KVConnectorBase_V1, KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.connector.metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    check_metadata_roundtrip,
)
from kvconnector_core.plugins.registry import ConnectorRegistry, create_connector
from kvconnector_core.testing import factories
from kvconnector_core.testing.hook_order import WORKER_STEP_HOOKS, check_hook_order, record_calls

if TYPE_CHECKING:
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
    from kvconnector_core.scheduler.output import SchedulerOutput

MAX_DRAIN_STEPS = 16
"""Empty steps a delayed free may take to be reported in ``finished_sending``."""

__all__ = ["ConnectorContract"]

def _is_pair_of_sets(value: Any) -> bool:
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(v is None or isinstance(v, set) for v in value)
    )


class ConnectorContract:
    """Contract tests for one connector configuration (see the module docstring).

    Attributes:
        connector_config: the config the tests create the connector from (required).
        registry: registry to resolve the name in; None = the default registry.
        engine: ``"kvconnector"`` (the default) or ``"vllm"``: the engine-bound tests
            (construction, lifecycle, empty step, delayed free, shutdown pins) run as
            scenarios under vLLM 0.33's scheduler behind kvconnector's adapter
            (:mod:`kvconnector_core.testing.vllm.kit`; needs vLLM); the others check the
            connector's API and run the same under both.
    """

    connector_config: ClassVar[KVConnectorConfig]
    registry: ClassVar[ConnectorRegistry | None] = None
    engine: ClassVar[str] = "kvconnector"

    def _ran_in_vllm(self, scenario: str) -> bool:
        """Under ``engine = "vllm"``, run ``scenario`` in the vLLM rig instead."""
        if self.engine != "vllm":
            return False
        from kvconnector_core.testing.vllm.kit import run_vllm_contract_scenario

        run_vllm_contract_scenario(self.connector_config, scenario)
        return True

    # ------------------------------------------------------------- overridable

    def make_kv_cache_config(self) -> KVCacheConfig:
        """Return the KV cache layout the connector is created with."""
        return factories.make_kv_cache_config()

    def make_connector(self, role: KVConnectorRole,
                       kv_cache_config: KVCacheConfig) -> KVConnectorBase_V1:
        """Create the connector under test for ``role``."""
        return create_connector(self.connector_config, role, kv_cache_config,
                                registry=self.registry)

    # ----------------------------------------------------------------- helpers

    def _pair(self) -> tuple[KVConnectorBase_V1, KVConnectorBase_V1, KVCacheConfig]:
        kvc = self.make_kv_cache_config()
        return (self.make_connector(KVConnectorRole.SCHEDULER, kvc),
                self.make_connector(KVConnectorRole.WORKER, kvc), kvc)

    @staticmethod
    def _step(sched: KVConnectorBase_V1, worker: KVConnectorBase_V1,
              so: SchedulerOutput) -> KVConnectorOutput:
        """Run one step's connector hooks on both sides, as the engine does; return the output."""
        meta = check_metadata_roundtrip(sched.build_connector_meta(so))
        worker.bind_connector_metadata(meta)
        worker.handle_preemptions(meta)
        worker.start_load_kv()
        worker.wait_for_save()
        results = worker.get_transfer_results(set(so.finished_req_ids))
        out = KVConnectorOutput(
            finished_sending=set(results.finished_sending),
            finished_recving=set(results.finished_recving),
            failed_recving=set(results.failed_recving),
            invalid_block_ids=set(worker.get_block_ids_with_load_errors()),
            kv_connector_stats=worker.get_kv_connector_stats(),
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        worker.clear_connector_metadata()
        sched.update_connector_output(out)
        return out

    @staticmethod
    def _admit(sched: KVConnectorBase_V1, manager: Any, request: Any) -> None:
        """Admit ``request`` with no external tokens (its local prefix hit included)."""
        computed, local = manager.get_computed_blocks(request)
        sched.get_num_new_matched_tokens(request, local)
        blocks = manager.allocate_slots(request, request.num_tokens - local, local, computed)
        assert blocks is not None
        request.num_computed_tokens = local
        sched.update_state_after_alloc(request, manager.get_blocks(request.request_id), 0)

    def _schedule_one_request(self, sched: KVConnectorBase_V1, worker: KVConnectorBase_V1,
                              kvc: KVCacheConfig) -> tuple[Any, Any, Any]:
        """Bind a real pool and KV caches, admit a 4-block request and run its full step.

        Returns:
            ``(kv_cache_manager, request, block_ids)``.
        """
        manager = factories.make_kv_cache_manager(kvc)
        sched.bind_gpu_block_pool(manager.block_pool)
        worker.register_kv_caches(factories.make_kv_caches(kvc))
        request = factories.make_request(4 * factories.BLOCK_SIZE + 1)
        self._admit(sched, manager, request)
        block_ids = manager.get_block_ids(request.request_id)
        self._step(sched, worker,
                   factories.scheduler_output_for([(request, block_ids, request.num_tokens)]))
        return manager, request, block_ids

    # ------------------------------------------------------------------- tests

    def test_constructs_in_both_roles(self) -> None:
        """The connector can be created as scheduler and as worker, and knows its role."""
        if self._ran_in_vllm("constructs"):
            return
        sched, worker, _ = self._pair()
        try:
            assert sched.role is KVConnectorRole.SCHEDULER
            assert worker.role is KVConnectorRole.WORKER
            assert isinstance(sched, KVConnectorBase_V1)
        finally:
            sched.shutdown()
            worker.shutdown()

    def test_abstract_hooks_implemented(self) -> None:
        """The class is concrete, named, and overrides every abstract hook."""
        sched, worker, _ = self._pair()
        cls = type(sched)
        try:
            assert not inspect.isabstract(cls), sorted(getattr(cls, "__abstractmethods__", ()))
            assert isinstance(cls.name, str) and cls.name
            for hook in ABSTRACT_HOOKS:
                assert getattr(cls, hook) is not getattr(KVConnectorBase_V1, hook), hook
            assert issubclass(cls.metadata_type, KVConnectorMetadata)
        finally:
            sched.shutdown()
            worker.shutdown()

    def test_build_meta_on_empty_step_roundtrips(self) -> None:
        """``build_connector_meta`` on an empty step returns its ``metadata_type``, which
        survives msgpack."""
        sched, worker, _ = self._pair()
        try:
            sched.bind_gpu_block_pool(factories.make_block_pool())
            meta = sched.build_connector_meta(factories.empty_scheduler_output())
            assert isinstance(meta, KVConnectorMetadata)
            assert type(meta) is type(sched).metadata_type, (
                f"{type(sched).__name__}.metadata_type is {type(sched).metadata_type.__name__} "
                f"but build_connector_meta returned {type(meta).__name__}"
            )
            check_metadata_roundtrip(meta)
        finally:
            sched.shutdown()
            worker.shutdown()

    def test_matched_tokens_on_fresh_request(self) -> None:
        """A fresh request gets ``(int >= 0 | None, bool)``, the same answer when asked twice."""
        if self._ran_in_vllm("lifecycle"):
            return
        sched, worker, _ = self._pair()
        try:
            sched.bind_gpu_block_pool(factories.make_block_pool())
            request = factories.make_request()
            first = sched.get_num_new_matched_tokens(request, 0)
            second = sched.get_num_new_matched_tokens(request, 0)
            assert isinstance(first, tuple) and len(first) == 2
            num_tokens, load_async = first
            assert num_tokens is None or (isinstance(num_tokens, int) and num_tokens >= 0)
            assert isinstance(load_async, bool)
            if num_tokens == 0:
                assert load_async is False
            assert first == second
        finally:
            sched.shutdown()
            worker.shutdown()

    def test_scheduler_lifecycle_of_one_request(self) -> None:
        """Admission, allocation, planning, output and finish run on real blocks."""
        if self._ran_in_vllm("lifecycle"):
            return
        sched, worker, kvc = self._pair()
        try:
            manager = factories.make_kv_cache_manager(kvc)
            sched.bind_gpu_block_pool(manager.block_pool)
            request = factories.make_request()
            _, local = manager.get_computed_blocks(request)
            sched.get_num_new_matched_tokens(request, local)
            blocks = manager.allocate_slots(request, request.num_tokens - local)
            assert blocks is not None
            sched.update_state_after_alloc(request, manager.get_blocks(request.request_id), 0)
            out = factories.scheduler_output_for(
                [(request, manager.get_block_ids(request.request_id), request.num_tokens)])
            check_metadata_roundtrip(sched.build_connector_meta(out))
            sched.update_connector_output(KVConnectorOutput())
            result = sched.request_finished(request, manager.get_block_ids(request.request_id)[0])
            assert isinstance(result, tuple) and len(result) == 2
            assert isinstance(result[0], bool)
            assert result[1] is None or isinstance(result[1], dict)
            list(sched.take_events())
        finally:
            sched.shutdown()
            worker.shutdown()

    def test_event_snapshot_is_well_formed(self) -> None:
        """``get_event_snapshot`` after real work: KV events only, and per medium an
        ``AllBlocksCleared(medium=M)`` before any ``BlockStored`` of ``M`` (no removals)."""
        from kvconnector_core.kv_events import AllBlocksCleared, BlockStored

        sched, worker, kvc = self._pair()
        try:
            self._schedule_one_request(sched, worker, kvc)
            list(sched.take_events())
            cleared: set[str | None] = set()
            for event in sched.get_event_snapshot():
                if isinstance(event, AllBlocksCleared):
                    assert event.medium is not None, (
                        "a snapshot clears one medium, not every medium")
                    cleared.add(event.medium)
                else:
                    assert isinstance(event, BlockStored), (
                        f"a snapshot holds clears and stores only: {event!r}")
                    assert event.medium in cleared, (
                        f"BlockStored for medium {event.medium!r} before "
                        f"AllBlocksCleared(medium={event.medium!r})")
        finally:
            sched.shutdown()
            worker.shutdown()

    def test_worker_hooks_in_reference_order_on_empty_step(self) -> None:
        """The worker hooks run without error, in the reference order, on two empty steps.

        The calls the connector receives are recorded and checked against
        :data:`WORKER_STEP_HOOKS`, so the test cannot drift from the order it promises.
        """
        if self._ran_in_vllm("empty_step"):
            return
        sched, worker, kvc = self._pair()
        try:
            sched.bind_gpu_block_pool(factories.make_block_pool(kvc.num_blocks))
            worker.register_kv_caches(factories.make_kv_caches(kvc))
            calls = record_calls(worker, WORKER_STEP_HOOKS)
            for _ in range(2):  # two steps: state must reset between them
                meta = check_metadata_roundtrip(
                    sched.build_connector_meta(factories.empty_scheduler_output()))
                worker.bind_connector_metadata(meta)
                assert worker.has_connector_metadata()
                worker.handle_preemptions(meta)
                worker.start_load_kv()
                worker.wait_for_save()
                results = worker.get_transfer_results(set())
                assert not results.finished_sending
                errors = worker.get_block_ids_with_load_errors()
                assert isinstance(errors, set)
                stats = worker.get_kv_connector_stats()
                assert stats is None or isinstance(stats, dict)
                worker.build_connector_worker_meta()
                worker.clear_connector_metadata()
                assert not worker.has_connector_metadata()
            check_hook_order(calls, WORKER_STEP_HOOKS * 2)
        finally:
            sched.shutdown()
            worker.shutdown()

    def test_get_finished_returns_pairs(self) -> None:
        """``get_finished`` returns two ``set | None`` values."""
        sched, worker, kvc = self._pair()
        try:
            worker.register_kv_caches(factories.make_kv_caches(kvc))
            worker.bind_connector_metadata(sched.build_connector_meta(factories.empty_scheduler_output()))
            assert _is_pair_of_sets(worker.get_finished(set()))
            worker.clear_connector_metadata()
        finally:
            sched.shutdown()
            worker.shutdown()

    def test_delayed_free_is_eventually_reported(self) -> None:
        """A request whose free ``request_finished`` delays shows up in ``finished_sending`` once.

        The request is scheduled in full (so a saving connector plans its saves),
        finishes, and empty steps follow until it is reported (at most
        :data:`MAX_DRAIN_STEPS`).
        """
        if self._ran_in_vllm("delayed_free"):
            return
        sched, worker, kvc = self._pair()
        try:
            _, request, block_ids = self._schedule_one_request(sched, worker, kvc)
            request.num_computed_tokens = request.num_tokens
            delay, _ = sched.request_finished(request, list(block_ids[0]))
            reported = 0
            finished = {request.request_id}
            for _ in range(MAX_DRAIN_STEPS):
                so = factories.empty_scheduler_output()
                so.finished_req_ids = finished
                finished = set()
                out = self._step(sched, worker, so)
                reported += request.request_id in out.finished_sending
            if delay:
                assert reported == 1, (
                    f"request_finished delayed the free of {request.request_id!r}, which was "
                    f"reported {reported} times in finished_sending over {MAX_DRAIN_STEPS} "
                    "steps (want exactly once)"
                )
            else:
                assert reported == 0, (
                    "a request whose free was not delayed must not be reported as sent")
        finally:
            sched.shutdown()
            worker.shutdown()

    def test_shutdown_releases_every_gpu_pin(self) -> None:
        """After both requests finish and ``shutdown`` runs, the pool's free-block count is
        back to its start.

        The second request hits the first one's prefix, so a pinning connector
        pins something; shutdown must release it (no leaked ``touch``).
        """
        if self._ran_in_vllm("shutdown_pins"):
            return
        sched, worker, kvc = self._pair()
        try:
            manager = factories.make_kv_cache_manager(kvc)
            pool = manager.block_pool
            sched.bind_gpu_block_pool(pool)
            start = pool.get_num_free_blocks()
            prompt = list(range(3 * factories.BLOCK_SIZE + 1))
            for _ in range(2):
                request = factories.make_request(prompt_token_ids=prompt)
                self._admit(sched, manager, request)
                manager.cache_blocks(request, request.num_tokens)
                request.num_computed_tokens = request.num_tokens
                sched.request_finished(request, list(manager.get_block_ids(request.request_id)[0]))
                manager.free(request)
        finally:
            sched.shutdown()
            worker.shutdown()
        assert pool.get_num_free_blocks() == start, (
            f"{pool.get_num_free_blocks()} free blocks after shutdown, {start} before: "
            f"{start - pool.get_num_free_blocks()} GPU blocks are still pinned"
        )

    def test_shutdown_is_idempotent(self) -> None:
        """``shutdown`` can be called twice on both sides, after real work; the second call
        changes nothing (no block released twice, no pin left)."""
        sched, worker, kvc = self._pair()
        manager = factories.make_kv_cache_manager(kvc)
        pool = manager.block_pool
        sched.bind_gpu_block_pool(pool)
        worker.register_kv_caches(factories.make_kv_caches(kvc))
        start = pool.get_num_free_blocks()
        prompt = list(range(3 * factories.BLOCK_SIZE + 1))
        for _ in range(2):  # the second request hits the first one's prefix
            request = factories.make_request(prompt_token_ids=prompt)
            self._admit(sched, manager, request)
            manager.cache_blocks(request, request.num_tokens)
            self._step(sched, worker, factories.scheduler_output_for(
                [(request, manager.get_block_ids(request.request_id), request.num_tokens)]))
            request.num_computed_tokens = request.num_tokens
            sched.request_finished(request, list(manager.get_block_ids(request.request_id)[0]))
            manager.free(request)
        after: list[tuple[int, list[int]]] = []
        for call in ("first", "second"):
            try:
                sched.shutdown()
                worker.shutdown()
            except Exception as exc:  # e.g. the pool refusing a block released twice
                msg = f"the {call} shutdown raised {type(exc).__name__}: {exc}"
                raise AssertionError(msg) from exc
            after.append((pool.get_num_free_blocks(), [b.ref_cnt for b in pool.blocks[1:]]))
        assert after[0] == after[1], "the second shutdown changed the block pool"
        free, ref_counts = after[1]
        assert free == start and all(r == 0 for r in ref_counts), (
            f"after two shutdowns: {free} free blocks (want {start}), "
            f"ref counts {sorted(set(ref_counts))}")

    def test_bind_gpu_block_pool_accepts_real_pool(self) -> None:
        """``bind_gpu_block_pool`` accepts the real BlockPool (which satisfies GPUBlockPoolView)."""
        if self._ran_in_vllm("lifecycle"):
            return
        from kvconnector_core.kv_cache.block_pool import GPUBlockPoolView

        sched, worker, _ = self._pair()
        try:
            pool = factories.make_block_pool()
            assert isinstance(pool, GPUBlockPoolView)
            sched.bind_gpu_block_pool(pool)
            assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # binding pins nothing
        finally:
            sched.shutdown()
            worker.shutdown()
