"""The kit's fault injection: failed stores that are checked, per-hook raises, late completions,
and the config-built wrapper (tests of the older fault types are in test_connector_base.py)."""

from __future__ import annotations

import pytest

from kvconnector_core.connector import KVConnectorConfig, KVConnectorRole
from kvconnector_core.connector.metadata import KVConnectorTransferResults
from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.engine.workloads import TraceRequest
from kvconnector_core.errors import ConfigError
from kvconnector_core.testing import (
    FaultInjectingConnector,
    FaultInjector,
    FaultSettings,
    HookFault,
    InjectedFault,
    RecordingConnector,
    fault_injection_config,
    make_kv_cache_config,
    make_kv_cache_manager,
    make_request,
    scheduler_output_for,
)

REC = KVConnectorConfig(name="RecordingConnector", module_path="kvconnector_core.testing.recording",
                        extra_config={"hit_tokens": 8})


def _sched(rate: float, **kw) -> tuple[FaultInjectingConnector, object]:
    kvc = make_kv_cache_config()
    return (FaultInjectingConnector(RecordingConnector(REC, KVConnectorRole.SCHEDULER, kvc),
                                    store_failure_rate=rate, **kw), make_kv_cache_manager(kvc))


def _compute(sched, manager, request) -> None:
    """Admit ``request`` with no hit and plan a step that computes its whole prompt."""
    assert manager.allocate_slots(request, request.num_tokens) is not None
    sched.update_state_after_alloc(request, manager.get_blocks(request.request_id), 0)
    sched.build_connector_meta(scheduler_output_for(
        [(request, manager.get_block_ids(request.request_id), request.num_tokens)]))


def test_failed_store_claimed_by_a_lookup_is_recorded_and_fails_the_check():
    """store_failure_rate=1: the blocks a step completes are failed stores; claiming them is
    caught."""
    sched, manager = _sched(1.0)
    first = make_request(13, request_id="a")
    assert sched.get_num_new_matched_tokens(first, 0) == (8, False)  # nothing failed yet
    assert sched.failed_store_hits == []
    _compute(sched, manager, first)
    again = make_request(13, request_id="b")  # same prompt: same block hashes
    assert sched.get_num_new_matched_tokens(again, 0) == (8, False)
    assert [(h.request_id, h.block_indices) for h in sched.failed_store_hits] == [("b", (0, 1))]
    assert sched.get_kv_connector_stats()["failed_stores_visible"] == 1
    with pytest.raises(AssertionError, match="claimed blocks whose stores failed"):
        sched.check_failed_stores_invisible()


def test_blocks_stored_again_without_failure_are_visible_again():
    sched, manager = _sched(1.0)
    _compute(sched, manager, make_request(13, request_id="a"))
    sched.store_failure_rate = 0.0  # the next step's stores succeed
    _compute(sched, manager, make_request(13, request_id="b"))
    sched.get_num_new_matched_tokens(make_request(13, request_id="c"), 0)
    sched.check_failed_stores_invisible()


def test_no_store_failures_no_record():
    sched, manager = _sched(0.0)
    _compute(sched, manager, make_request(13, request_id="a"))
    sched.get_num_new_matched_tokens(make_request(13, request_id="b"), 0)
    sched.check_failed_stores_invisible()


def test_store_failure_raises_from_wait_for_save_after_the_inner_ran():
    kvc = make_kv_cache_config()
    sched, _ = _sched(1.0)
    inner = RecordingConnector(REC, KVConnectorRole.WORKER, kvc)
    worker = FaultInjectingConnector(inner, store_failure_rate=1.0)
    worker.bind_connector_metadata(sched.build_connector_meta(scheduler_output_for([])))
    with pytest.raises(InjectedFault, match="store failure"):
        worker.wait_for_save()
    assert "wait_for_save" in inner.hooks_called()


def _raises(wrapper: FaultInjectingConnector, calls: int) -> list[int]:
    raised = []
    for i in range(calls):
        try:
            wrapper.take_events()
        except InjectedFault:
            raised.append(i)
    return raised


def test_hook_raises_at_a_rate_reproducibly():
    def pattern(seed: int) -> list[int]:
        inner = RecordingConnector(REC, KVConnectorRole.SCHEDULER, make_kv_cache_config())
        return _raises(
            FaultInjectingConnector(inner, raise_in={"take_events": 0.3}, seed=seed), 300
        )

    raised = pattern(7)
    assert 45 < len(raised) < 135  # ~90 expected
    assert pattern(7) == raised
    assert pattern(8) != raised


def test_hook_raises_once_at_the_first_call_from_a_step():
    inner = RecordingConnector(REC, KVConnectorRole.SCHEDULER, make_kv_cache_config())
    sched = FaultInjectingConnector(inner, raise_in=[HookFault(hook="take_events", at_step=2)])
    assert _raises(sched, 3) == []  # step 0
    sched.build_connector_meta(scheduler_output_for([]))
    sched.build_connector_meta(scheduler_output_for([]))  # now step 2
    assert _raises(sched, 3) == [0]
    sched.build_connector_meta(scheduler_output_for([]))
    assert _raises(sched, 3) == []
    assert sched.num_injected["raises"] == 1


def test_raising_hook_does_not_reach_the_inner_connector():
    inner = RecordingConnector(REC, KVConnectorRole.SCHEDULER, make_kv_cache_config())
    sched = FaultInjectingConnector(inner, raise_in=["request_finished"])
    with pytest.raises(InjectedFault, match="request_finished"):
        sched.request_finished(make_request(5), [])
    assert "request_finished" not in inner.hooks_called()


@pytest.mark.parametrize(
    "bad",
    [
        {"raise_in": [{"hook": "nope"}]},
        {"raise_in": [{"hook": "take_events", "rate": 1.5}]},
        {"raise_in": [{"hook": "take_events"}, {"hook": "take_events", "rate": 0.1}]},
        {"completion_delay_steps": -1},
        {"store_failure_rate": -0.1},
        {"no_such_setting": 1},
    ],
)
def test_bad_settings_are_config_errors(bad):
    with pytest.raises(ConfigError):
        FaultSettings.from_dict(bad)


class _Finisher(RecordingConnector):
    """Reports every request it is given as finished sending, at once."""

    def get_transfer_results(self, finished_req_ids):
        return KVConnectorTransferResults(finished_sending=set(finished_req_ids))


def test_late_completions_arrive_later_and_out_of_order():
    kvc = make_kv_cache_config()
    sched = FaultInjectingConnector(RecordingConnector(REC, KVConnectorRole.SCHEDULER, kvc))
    worker = FaultInjectingConnector(
        _Finisher(REC, KVConnectorRole.WORKER, kvc), completion_delay_steps=3, seed=1
    )
    arrivals: dict[str, int] = {}
    ids = [f"r{i}" for i in range(12)]
    for step in range(20):
        worker.bind_connector_metadata(sched.build_connector_meta(scheduler_output_for([])))
        res = worker.get_transfer_results({ids[step]} if step < len(ids) else set())
        worker.clear_connector_metadata()
        arrivals.update(dict.fromkeys(res.finished_sending, step))
    assert set(arrivals) == set(ids)  # each reported, once, within the delay
    delays = [arrivals[r] - i for i, r in enumerate(ids)]
    assert all(0 <= d <= 3 for d in delays) and max(delays) > 0
    assert sorted(ids, key=lambda r: (arrivals[r], r)) != ids  # some overtook others
    assert worker.num_injected["late"] == sum(1 for d in delays if d)


def _trace() -> list[TraceRequest]:
    prompt = list(range(1, 30))
    return [
        TraceRequest(arrival=0, prompt_token_ids=prompt, max_new_tokens=3, request_id="a"),
        TraceRequest(arrival=15, prompt_token_ids=prompt, max_new_tokens=3, request_id="b"),
    ]


def test_fault_injection_config_runs_in_the_engine():
    """The config-built wrapper runs a connector in the engine; without faults outputs are
    unchanged."""
    memory = {"name": "InMemoryConnector", "module_path": "_memory_connector"}
    cfg = {"num_gpu_blocks": 64, "max_model_len": 128, "enable_prefix_caching": False}
    baseline = Engine(EngineConfig(**cfg)).run(_trace())
    eng = Engine(EngineConfig(connector=fault_injection_config(memory), **cfg))
    assert isinstance(eng.scheduler_connector, FaultInjector)
    result = eng.run(_trace())
    assert result.outputs == baseline.outputs
    assert result.metrics.connector_hit_tokens > 0
    eng.scheduler_connector.check_failed_stores_invisible()


def test_fault_injection_config_checks_its_settings():
    with pytest.raises(ConfigError, match="no_such"):
        FaultInjector(
            KVConnectorConfig(
                name="FaultInjector", extra_config={"inner": REC.to_dict(), "no_such": 1}
            ),
            KVConnectorRole.SCHEDULER,
        )
    with pytest.raises(ConfigError, match="inner"):
        FaultInjector(KVConnectorConfig(name="FaultInjector"), KVConnectorRole.SCHEDULER)
    wrapped = fault_injection_config(
        {**REC.to_dict(), "load_failure_policy": "fail"}, FaultSettings(store_failure_rate=0.5)
    )
    assert wrapped.load_failure_policy == "fail"
    built = FaultInjector(wrapped, KVConnectorRole.SCHEDULER)
    assert built.store_failure_rate == 0.5 and isinstance(built.inner, RecordingConnector)


def test_a_plan_reported_failed_makes_its_stores_failed_stores():
    """plan_failed(stores_failed=True) from the guard: that step's new blocks must stay
    invisible."""
    sched, manager = _sched(0.0)
    first = make_request(13, request_id="a")
    assert manager.allocate_slots(first, first.num_tokens) is not None
    sched.update_state_after_alloc(first, manager.get_blocks("a"), 0)
    plan = sched.build_connector_meta(
        scheduler_output_for([(first, manager.get_block_ids("a"), 13)])
    )
    sched.plan_failed(plan, loads_failed=False, stores_failed=True)
    sched.get_num_new_matched_tokens(make_request(13, request_id="b"), 0)
    assert [h.request_id for h in sched.failed_store_hits] == ["b"]


def test_a_good_step_counts_every_full_block_of_its_requests_as_stored():
    """A connector may store a prefix it missed in a later step: no false report then."""
    sched, manager = _sched(1.0)
    _compute(sched, manager, make_request(13, request_id="a"))  # stores fail
    sched.store_failure_rate = 0.0
    again = make_request(13, request_id="b")
    assert manager.allocate_slots(again, again.num_tokens) is not None
    sched.update_state_after_alloc(again, manager.get_blocks("b"), 0)
    again.num_computed_tokens = 12  # a prefix hit: only the last token is computed
    sched.build_connector_meta(scheduler_output_for([(again, manager.get_block_ids("b"), 1)]))
    sched.get_num_new_matched_tokens(make_request(13, request_id="c"), 0)
    sched.check_failed_stores_invisible()


def test_injected_fault_stats_are_deltas_so_the_engine_total_is_right():
    """The wrapper reports per-step deltas, not running totals the engine would sum (a run
    with 18 injected raises would report 233)."""
    from kvconnector_core.connector.config import KVConnectorConfig
    from kvconnector_core.engine.engine import Engine
    from kvconnector_core.testing import FaultSettings, data_check_workloads, fault_injection_config

    work = data_check_workloads()["repeated_prefixes"]
    config = fault_injection_config(
        KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 64}),
        FaultSettings(store_failure_rate=0.3, load_failure_rate=0.3),
    )
    with Engine(work.engine_config(config)) as engine:
        result = engine.run(list(work.requests))
        worker, sched = engine.worker_connector, engine.scheduler_connector
    stats = result.metrics.connector_stats
    assert worker.num_injected["stores"] > 0 and sched.num_injected["loads"] > 0
    assert stats["injected_faults.stores"] == worker.num_injected["stores"]
    assert stats["scheduler.injected_faults.loads"] == sched.num_injected["loads"]


def test_the_wrapper_forwards_every_hook_of_the_contract():
    """A wrapped connector must behave as it does unwrapped but for the faults: every hook
    a connector may implement reaches it (bind_kv_cache_manager excepted: its default
    calls bind_gpu_block_pool, which the wrapper forwards)."""
    from kvconnector_core.connector.base import ABSTRACT_HOOKS, OPTIONAL_HOOKS

    missing = [h for h in (*ABSTRACT_HOOKS, *OPTIONAL_HOOKS)
               if h != "bind_kv_cache_manager" and h not in vars(FaultInjectingConnector)]
    assert missing == []


def test_reset_cache_reaches_the_wrapped_connector_or_raises():
    calls = []

    class Resetting(RecordingConnector):
        def reset_cache(self) -> bool:
            calls.append("reset_cache")
            return False

    kvc = make_kv_cache_config()
    wrapped = FaultInjectingConnector(Resetting(REC, KVConnectorRole.SCHEDULER, kvc))
    assert wrapped.reset_cache() is False and calls == ["reset_cache"]
    raising = FaultInjectingConnector(Resetting(REC, KVConnectorRole.SCHEDULER, kvc),
                                      raise_in=[HookFault(hook="reset_cache", rate=1.0)])
    with pytest.raises(InjectedFault):
        raising.reset_cache()
    assert calls == ["reset_cache"]


def test_worker_kv_events_of_the_wrapped_connector_pass_through():
    kvc = make_kv_cache_config()

    class Evented(RecordingConnector):
        def get_kv_connector_kv_cache_events(self) -> list[str]:
            return ["stored"]

    assert FaultInjectingConnector(Evented(REC, KVConnectorRole.WORKER, kvc)
                                   ).get_kv_connector_kv_cache_events() == ["stored"]
    assert FaultInjectingConnector(RecordingConnector(REC, KVConnectorRole.WORKER, kvc)
                                   ).get_kv_connector_kv_cache_events() is None
