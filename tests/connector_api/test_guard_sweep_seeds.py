"""Fault-sweep runs that once did damage are clean, and the damage each did cannot recur:

- wrong output: a step whose plan was lost (``build_connector_meta`` raised) ran its
  forward over sync-loaded blocks that were never loaded, and sampled from them;
- request state left at the end: ``forget_requests`` kept per-request state (the in-memory
  test connector, the offload connector's GPU-hit notes, the TTL example's lookups) after
  ``request_finished`` raised;
- a CPU replica short for steps after ``take_events`` raised (the resync's drain or
  snapshot failed and was only retried next step);
- CPU slots and state held at the end: the engine went idle while a connector still had
  stores to submit or a report to redeliver (now ``has_pending_work``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from kvconnector_core.connector import KVConnectorConfig
from tests._flaky import FlakyHook
from tests.connector_api.test_guard_single_raise import engine, trace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _fault_runs as fr  # noqa: E402  (puts tests/ on the path for module_path="_memory_connector")
from _memory_connector import InMemoryConnector  # noqa: E402  (the module the engine loads)


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.CRITICAL)  # every contained raise is logged with a traceback


def test_a_lost_plan_in_the_step_of_a_sync_load_samples_nothing_from_unloaded_blocks(monkeypatch):
    memory = KVConnectorConfig(name="InMemoryConnector", module_path="_memory_connector",
                               extra_config={"load_async": False})
    flaky = FlakyHook(monkeypatch, InMemoryConnector, "build_connector_meta",
                      when=lambda conn, so: bool(conn._loads))
    expected = engine(None).run(trace()).outputs
    result = engine(memory).run(trace())
    assert flaky.raised == 1
    assert result.outputs == expected


def test_forget_after_raising_hooks_leaves_no_request_state_in_the_offload_connector(monkeypatch):
    """The lookup's GPU-hit note was only dropped by update_state_after_alloc or
    request_finished; when both raise, forget_requests must drop it."""
    from connectors.offload.connector import OffloadingConnector

    eng = engine(
        {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 16, "blocks_per_chunk": 2}}
    )
    FlakyHook(monkeypatch, OffloadingConnector, "update_state_after_alloc", rate=1.0)
    FlakyHook(monkeypatch, OffloadingConnector, "request_finished", rate=1.0)
    eng.run(trace())
    side = eng.scheduler_connector.scheduler_side
    assert not side.load_planner._gpu_hit_tokens and not side.state.reqs


# Runs of the sweep that once did damage, with the check they failed.
ONCE_DAMAGED = [
    ("memory", "raise_10pct", 49),  # wrong_output (a lost plan over a sync load)
    ("memory", "raise_10pct", 0),  # req_state (InMemoryConnector._reqs)
    ("memory", "raise_10pct", 40),  # req_state (saves still pending when the engine went idle)
    ("cpu_offload", "raise_10pct", 1),  # replica, req_state (_gpu_hit_tokens)
    ("cpu_offload", "raise_10pct", 61),  # cpu_slots, req_state
    ("multi", "raise_10pct", 16),  # cpu_slots, req_state (an undelivered report)
    ("multi", "raise_10pct", 28),  # cpu_slots, req_state (GuardedWorker._unseen_finished)
    ("multi", "raise_10pct", 3),  # replica
]


@pytest.mark.parametrize(
    ("connector", "fault", "seed"), ONCE_DAMAGED, ids=[f"{c}-{f}-{s}" for c, f, s in ONCE_DAMAGED]
)
def test_sweep_runs_that_once_did_damage_are_clean(connector, fault, seed):
    outcome = fr.run_cell(connector, fault, seed)
    assert not outcome.failed, outcome.detail
