"""One hook raising once, at the step where it does damage, with the CPU offload connector
(alone or inside a MultiConnector): no wrong tokens, no deadlock, no state left behind.
"""

from __future__ import annotations

import logging

import pytest

from connectors.offload.connector import OffloadingConnector
from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.engine.workloads import TraceRequest
from kvconnector_core.worker.model import ModelConfig
from tests._flaky import FlakyHook

OFFLOAD = {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 16, "blocks_per_chunk": 2}}
TTL = {"name": "ttl", "extra_config": {"ttl_seconds": 1000, "max_pinned_blocks": 4}}
MULTI = {"name": "MultiConnector", "extra_config": {"connectors": [TTL, OFFLOAD]}}
PROMPT = [(7 * i + 3) % 997 for i in range(97)]


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.CRITICAL)  # every contained raise is logged with a traceback


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def engine(connector: dict | None) -> Engine:
    # No GPU prefix cache: the second request can only hit through the CPU tier. A 32-token
    # budget prefills the 97-token prompt over four steps, each adding two blocks.
    return Engine(
        EngineConfig(
            model=ModelConfig(vocab_size=1000, layer_types=("full", "full")),
            connector=connector,
            num_gpu_blocks=24,
            block_size=16,
            max_model_len=128,
            max_num_batched_tokens=32,
            max_num_seqs=2,
            enable_prefix_caching=False,
        )
    )


def trace() -> list[TraceRequest]:
    """The same prompt twice; the second arrives after the first finished."""
    return [
        TraceRequest(request_id="first", arrival=0, prompt_token_ids=PROMPT, max_new_tokens=4),
        TraceRequest(request_id="second", arrival=30, prompt_token_ids=PROMPT, max_new_tokens=4),
    ]


def scheduler_side(eng: Engine):
    conn = eng.scheduler_connector
    if conn.name == "MultiConnector":
        conn = conn.children[-1]
    return getattr(conn, "scheduler_side", conn)


def run(monkeypatch, connector: dict, hook: str, **when) -> tuple[Engine, dict, dict]:
    baseline = engine(None).run(trace()).outputs
    flaky = FlakyHook(monkeypatch, OffloadingConnector, hook, **when)
    eng = engine(connector)
    outputs = eng.run(trace()).outputs
    assert flaky.raised == 1
    return eng, baseline, outputs


def has_loads(plan) -> bool:
    return bool(plan.loads)


def bound_plan(conn):
    side = getattr(conn, "worker_side", None)
    return side.plan if side is not None else conn._connector_metadata


def check_clean(eng: Engine) -> None:
    eng.step()  # an empty step tells the worker side which requests finished last
    eng.shutdown()
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    side = scheduler_side(eng)
    assert not side.state.jobs and not side.state.reqs
    assert all(entry.ref_cnt == 0 for _, entry in side.manager.policy)
    if eng.scheduler_connector.name == "MultiConnector":  # no per-request state left
        assert eng.scheduler_connector.num_request_states() == 0
        assert eng.worker_connector.num_request_states() == 0


@pytest.mark.parametrize("connector", [OFFLOAD, MULTI], ids=["offload", "ttl+offload"])
def test_one_failed_plan_during_a_chunked_prefill_stores_no_wrong_blocks(monkeypatch, connector):
    """build_connector_meta raising once made the connector miss that step's new blocks and
    later store other blocks under the prefix's hash: the second request read wrong KV."""
    eng, baseline, outputs = run(monkeypatch, connector, "build_connector_meta", at=1)
    assert outputs == baseline
    check_clean(eng)


@pytest.mark.parametrize("connector", [OFFLOAD, MULTI], ids=["offload", "ttl+offload"])
@pytest.mark.parametrize("hook", ["bind_connector_metadata", "start_load_kv"])
def test_a_failed_bind_or_load_start_when_a_load_is_planned_does_not_deadlock(
    monkeypatch, connector, hook
):
    """The second request's async load is planned in its admission step; a raise there used
    to leave it waiting forever (or its CPU chunks pinned)."""
    if hook == "bind_connector_metadata":
        when = lambda conn, plan: has_loads(plan)  # noqa: E731
    else:
        when = lambda conn, *_: has_loads(bound_plan(conn))  # noqa: E731
    eng, baseline, outputs = run(monkeypatch, connector, hook, when=when)
    assert outputs == baseline
    assert eng.scheduler.stats.num_failed_loads_recovered == 1
    check_clean(eng)


@pytest.mark.parametrize("connector", [OFFLOAD, MULTI], ids=["offload", "ttl+offload"])
@pytest.mark.parametrize("hook", ["wait_for_save", "update_connector_output", "request_finished"])
def test_a_raise_around_a_store_leaks_nothing(monkeypatch, connector, hook):
    """A raise in wait_for_save (a step with stores), update_connector_output (a report of
    finished stores) or request_finished leaves no CPU slot stuck half-stored, no job
    record and no request state of the connector behind."""
    when = {
        # the first step with stores
        "wait_for_save": lambda conn: bool(bound_plan(conn).stores),
        # the first report of finished store jobs
        "update_connector_output": lambda conn, out: out.kv_connector_worker_meta is not None,
        # the first request finishing, with stores in flight
        "request_finished": lambda conn, request, block_ids: True,
    }[hook]
    eng, baseline, outputs = run(monkeypatch, connector, hook, when=when)
    assert outputs == baseline
    check_clean(eng)


@pytest.mark.parametrize("connector", [OFFLOAD, MULTI], ids=["offload", "ttl+offload"])
def test_a_failed_plan_in_the_step_a_load_is_planned_loads_nothing_stale(monkeypatch, connector):
    """build_connector_meta raising in the step the second request's load was planned: alone,
    the load goes out with the next plan; inside a MultiConnector the load fails at once,
    so the child must drop it (a late load would write into blocks the request recomputes)."""
    eng, baseline, outputs = run(
        monkeypatch,
        connector,
        "build_connector_meta",
        when=lambda conn, so: bool(conn.scheduler_side.state.pending_loads),
    )
    assert outputs == baseline
    check_clean(eng)


def test_a_load_delayed_by_a_failed_plan_still_fails_cleanly_when_its_bind_fails(monkeypatch):
    """The load goes out one plan late; if that plan's bind then fails, the scheduler must
    still count the load as this plan's (else the request waits forever)."""
    FlakyHook(
        monkeypatch,
        OffloadingConnector,
        "build_connector_meta",
        when=lambda conn, so: bool(conn.scheduler_side.state.pending_loads),
    )
    eng, baseline, outputs = run(
        monkeypatch, OFFLOAD, "bind_connector_metadata", when=lambda conn, plan: has_loads(plan)
    )
    assert outputs == baseline
    assert eng.scheduler.stats.num_failed_loads_recovered == 1
    check_clean(eng)
