"""End to end: every hook of the built-in connectors raising, and what the guard guarantees.

For each hook, the CPU offload connector (alone, and inside a MultiConnector with the TTL
example) raises in it at 10% of calls (seeded) while the engine runs a workload that
reuses prefixes through the CPU tier. The documented consequence is checked
(``docs/failure-contract.md``): outputs identical to the no-connector baseline, no
deadlock (the engine raises after many steps without progress), no GPU block still
referenced, no CPU slot pinned or half-stored, no connector state left for any request.
"""

from __future__ import annotations

import logging
import random

import pytest

from connectors.offload.connector import OffloadingConnector
from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.engine.workloads import TraceRequest
from kvconnector_core.worker.model import ModelConfig
from tests._flaky import FlakyHook

OFFLOAD = {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 24, "blocks_per_chunk": 2}}
TTL = {"name": "ttl", "extra_config": {"ttl_seconds": 1000, "max_pinned_blocks": 4}}
MULTI = {"name": "MultiConnector", "extra_config": {"connectors": [TTL, OFFLOAD]}}

SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "take_events")
WORKER_HOOKS = (
    "bind_connector_metadata",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def trace(seed: int = 0) -> list[TraceRequest]:
    """Three documents asked about three times; the GPU pool cannot keep them all."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1000) for _ in range(64)] for _ in range(3)]
    return [
        TraceRequest(
            request_id=f"r{r}-{d}",
            arrival=r * 12 + d,
            max_new_tokens=6,
            prompt_token_ids=doc + [rng.randrange(1000) for _ in range(5)],
        )
        for r in range(3)
        for d, doc in enumerate(docs)
    ]


def engine(connector: dict | None) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(vocab_size=1000, layer_types=("full", "full")),
            connector=connector,
            num_gpu_blocks=14,
            block_size=16,
            max_model_len=128,
            max_num_batched_tokens=64,
            max_num_seqs=3,
            enable_kv_cache_events=True,
        )
    )


_BASELINE: dict[int, dict[str, list[int]]] = {}


def baseline(seed: int) -> dict[str, list[int]]:
    if seed not in _BASELINE:
        _BASELINE[seed] = engine(None).run(trace(seed)).outputs
    return _BASELINE[seed]


def offload_of(eng: Engine, side: str) -> OffloadingConnector:
    conn = eng.scheduler_connector if side == "scheduler" else eng.worker_connector
    if conn.name == "MultiConnector":
        conn = conn.children[-1]
    assert isinstance(conn, OffloadingConnector)
    return conn


def check_clean(eng: Engine) -> None:
    """Nothing is left held once every request finished (and the TTL child let its pins go)."""
    eng.step()  # an empty step tells the worker side which requests finished last
    eng.shutdown()
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # every ref count back to 0
    assert not eng.scheduler.has_unfinished_requests()
    sched = offload_of(eng, "scheduler").scheduler_side
    assert not sched.state.jobs and not sched.state.reqs and not sched.state.pending_loads
    # nothing pinned or half-stored
    assert all(entry.ref_cnt == 0 for _, entry in sched.manager.policy)
    assert not eng.scheduler.connector.detached
    if eng.scheduler_connector.name == "MultiConnector":
        assert eng.scheduler_connector.num_request_states() == 0
        assert eng.worker_connector.num_request_states() == 0


@pytest.mark.parametrize("connector", [OFFLOAD, MULTI], ids=["offload", "ttl+offload"])
@pytest.mark.parametrize("hook", SCHEDULER_HOOKS + WORKER_HOOKS)
def test_hook_raising_at_ten_percent_does_no_damage(monkeypatch, caplog, hook, connector):
    caplog.set_level(logging.CRITICAL)  # the guard logs every contained raise with its traceback
    flaky = FlakyHook(monkeypatch, OffloadingConnector, hook, rate=0.1, seed=3)
    eng = engine(connector)
    result = eng.run(trace(1))
    if hook == "save_kv_layer" and connector is OFFLOAD:
        # uses_layer_hooks = False: the runner skips the per-layer hooks (they do nothing).
        assert flaky.calls == 0
    elif hook != "wait_for_layer_load":  # offload never loads synchronously: not called
        assert flaky.raised > 0
    assert result.outputs == baseline(1)
    assert all(
        s in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED") for s in result.statuses.values()
    )
    check_clean(eng)


def test_per_layer_hooks_reach_a_connector_only_if_it_uses_them(monkeypatch):
    """OffloadingConnector declares uses_layer_hooks = False: the runner makes none of the
    two calls per layer; a connector that keeps the default (True) gets them."""
    calls = FlakyHook(monkeypatch, OffloadingConnector, "save_kv_layer")
    engine(OFFLOAD).run(trace(1))
    assert calls.calls == 0
    monkeypatch.setattr(OffloadingConnector, "uses_layer_hooks", True)
    engine(OFFLOAD).run(trace(1))
    assert calls.calls > 0


def test_without_faults_the_tier_serves_hits():
    """The workload above does reuse prefixes through the CPU tier (else the fault tests prove
    little)."""
    eng = engine(OFFLOAD)
    result = eng.run(trace(1))
    assert result.outputs == baseline(1)
    assert result.metrics.connector_hit_tokens > 0
    assert result.metrics.connector_errors == {}
    check_clean(eng)


@pytest.mark.parametrize(
    "drain_first", [False, True], ids=["raises-before", "raises-after-draining"]
)
def test_a_cpu_replica_stays_exact_when_take_events_raises(monkeypatch, caplog, drain_first):
    """No event is lost silently: after every step, a consumer applying the
    engine's event stream holds exactly the GPU block hashes the CPU tier can serve, while
    take_events raises in every other call that has events, before or after draining them."""
    from kvconnector_core.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        to_external_hash,
    )

    caplog.set_level(logging.CRITICAL)
    original = OffloadingConnector.take_events
    calls = {"with_events": 0}

    def flaky(conn):
        events = original(conn)
        if events:
            calls["with_events"] += 1
            if calls["with_events"] % 2:
                if not drain_first:  # as if it raised before draining: the events stay queued
                    conn.scheduler_side._wire_events[:0] = events
                raise RuntimeError("injected: take_events")
        return events

    monkeypatch.setattr(OffloadingConnector, "take_events", flaky)
    eng = engine(OFFLOAD)
    replica: set[int] = set()
    take = eng.scheduler.take_events

    def take_and_apply() -> list:
        events = take()
        for ev in events:
            if isinstance(ev, AllBlocksCleared) and ev.medium in (None, "CPU"):
                replica.clear()
            elif isinstance(ev, BlockStored) and ev.medium == "CPU":
                replica.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved) and ev.medium == "CPU":
                replica.difference_update(ev.block_hashes)
        return events

    eng.scheduler.take_events = take_and_apply  # type: ignore[method-assign]
    side = offload_of(eng, "scheduler").scheduler_side

    def check(_: int) -> None:
        infos = side.state.events.tables[0]._info
        assert replica == {
            to_external_hash(h)
            for key in side.manager.ready_keys()
            for h in infos[key].block_hashes
        }

    result = eng.run(trace(1), progress=check)
    assert result.outputs == baseline(1)
    assert result.metrics.connector_errors["take_events"] > 0 and replica
