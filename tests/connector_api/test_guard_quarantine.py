"""Quarantine: a connector whose hook keeps raising is cut off from loads and stores.

After ``KVConnectorConfig.quarantine_after_raises`` raises in a row of one hook, the guard
stops sending requests to the connector's scheduler side (every request is forgotten,
lookups are misses) or fails every step's loads and stores on its worker side, so the
connector only drains what it already had in flight. See docs/failure-contract.md.
"""

from __future__ import annotations

import logging

import pytest

from connectors.offload.connector import OffloadingConnector
from kvconnector_core.connector import KVConnectorConfig, KVConnectorMetadata, KVConnectorRole
from kvconnector_core.connector.guard import GuardedScheduler, GuardedWorker
from kvconnector_core.connector.metadata import KVConnectorOutput
from kvconnector_core.errors import ConfigError
from tests._flaky import FlakyHook
from tests.connector_api.test_guard import Probe, output, request
from tests.connector_api.test_guard_faults import (MULTI, OFFLOAD, baseline, check_clean, engine,
                                                   trace)


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.CRITICAL)  # every contained raise is logged with a traceback


def probe(after: int | None, role=None) -> Probe:
    p = Probe() if role is None else Probe(role)
    p._config = KVConnectorConfig(name="Probe", quarantine_after_raises=after)  # read by the guard
    return p


def test_a_hook_raising_n_times_in_a_row_quarantines_the_scheduler_side(caplog):
    caplog.set_level(logging.ERROR)
    conn = probe(3)
    guard = GuardedScheduler(conn)
    conn.fail["get_num_new_matched_tokens"] = 2
    guard.get_num_new_matched_tokens(request("a"), 0)
    guard.get_num_new_matched_tokens(request("a"), 0)
    # a success resets the streak
    assert guard.get_num_new_matched_tokens(request("a"), 0) == (4, True)
    conn.fail["get_num_new_matched_tokens"] = 3
    for _ in range(3):
        guard.get_num_new_matched_tokens(request("a"), 0)
    assert guard.quarantined and guard.errors["quarantined"] == 1
    assert [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()] == [
        "connector Probe quarantined: get_num_new_matched_tokens raised 3 times in a row; "
        "no more loads or stores go through it"]
    calls = len(conn.calls)
    assert guard.get_num_new_matched_tokens(request("b"), 0) == (0, False)  # not asked any more
    assert guard.update_state_after_alloc(request("b"), None, 0) is True
    assert len(conn.calls) == calls


def test_a_worker_hook_raising_in_steps_that_are_not_consecutive_is_not_quarantined():
    """A per-step worker hook's streak counts steps in a row: a step in which it did not
    raise ends the streak, so raising every other step never quarantines."""
    conn = probe(2, KVConnectorRole.WORKER)
    guard = GuardedWorker(conn)
    for raises in (True, False, True, False, True):
        guard.begin_step()
        guard.bind_connector_metadata(KVConnectorMetadata())
        if raises:
            conn.fail["save_kv_layer"] = 1
        guard.save_kv_layer("l0", None)
        guard.clear_connector_metadata()
    assert not guard.quarantined and guard.errors["save_kv_layer"] == 3


def test_a_success_of_a_contained_hook_ends_its_streak():
    """Hooks the guard runs through its generic containment (has_pending_work here) end
    their streak on a success, like the others: raise, succeed, raise is no quarantine."""
    conn = probe(2)
    answers = iter([RuntimeError, False, RuntimeError])

    def pending() -> bool:
        answer = next(answers)
        if answer is RuntimeError:
            raise RuntimeError("injected: has_pending_work")
        return answer

    conn.has_pending_work = pending  # type: ignore[method-assign]
    guard = GuardedScheduler(conn)
    for _ in range(3):
        guard.has_pending_work()
    assert not guard.quarantined and guard.errors["has_pending_work"] == 2


def test_a_quarantined_scheduler_side_forgets_every_scheduled_request_and_only_drains():
    conn = probe(1)
    guard = GuardedScheduler(conn)
    conn.fail["update_connector_output"] = 1
    guard.update_connector_output(KVConnectorOutput())
    assert guard.quarantined
    so = output(new=("a",), cached=("b",))
    guard.build_connector_meta(so)
    assert ("forget_requests", {"a", "b"}) in conn.calls and {"a", "b"} <= guard.detached
    shown = next(arg for hook, arg in conn.calls if hook == "build_connector_meta")
    assert not shown.scheduled_new_reqs and not shown.scheduled_cached_reqs.req_ids


def test_never_quarantines_with_none():
    conn = probe(None)
    guard = GuardedScheduler(conn)
    conn.fail["get_num_new_matched_tokens"] = 50
    for _ in range(50):
        guard.get_num_new_matched_tokens(request("a"), 0)
    assert not guard.quarantined


def test_a_quarantined_worker_side_fails_every_steps_loads_and_stores():
    from kvconnector_core.connector import KVConnectorRole

    conn = probe(2, KVConnectorRole.WORKER)
    guard = GuardedWorker(conn)
    guard.begin_step()
    assert not (guard.loads_failed or guard.stores_failed)
    conn.get_kv_connector_stats = lambda: 1 / 0  # type: ignore[method-assign]
    guard.get_kv_connector_stats()
    guard.get_kv_connector_stats()
    assert guard.quarantined
    guard.begin_step()
    assert guard.loads_failed and guard.stores_failed


def test_quarantine_after_raises_is_checked():
    with pytest.raises(
        ConfigError, match="quarantine_after_raises must be a number of raises >= 1 or None"
    ):
        KVConnectorConfig(name="x", quarantine_after_raises=0)
    assert KVConnectorConfig(name="x").quarantine_after_raises == 8


def test_a_multi_child_whose_plans_always_fail_is_quarantined_and_the_run_stays_clean(monkeypatch):
    flaky = FlakyHook(monkeypatch, OffloadingConnector, "build_connector_meta", rate=1.0)
    eng = engine(MULTI)
    result = eng.run(trace(1))
    assert flaky.raised >= 8
    assert result.outputs == baseline(1)
    child = eng.scheduler_connector.scheduler_side.guards[-1]
    assert child.quarantined and child.errors["quarantined"] == 1
    assert not eng.scheduler.connector.quarantined  # only the child
    check_clean(eng)


def test_an_offload_worker_whose_saves_always_fail_is_quarantined_and_the_run_stays_clean(
    monkeypatch,
):
    FlakyHook(monkeypatch, OffloadingConnector, "wait_for_save", rate=1.0)
    eng = engine(OFFLOAD)
    result = eng.run(trace(1))
    assert result.outputs == baseline(1)
    assert eng.model_runner.connector.quarantined
    assert result.metrics.connector_hit_tokens == 0  # nothing stored ever became visible
    check_clean(eng)
