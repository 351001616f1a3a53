"""Engine end to end: identical outputs with/without prefix caching, chunking and a
connector that moves real bytes; no deadlock with a tiny pool; delayed frees."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.engine.engine import Engine, EngineConfig, RunResult
from kvconnector_core.engine.workloads import get_workload, mixed, multi_turn_chat
from kvconnector_core.errors import ConfigError, RegistryError
from kvconnector_core.worker.model import ModelConfig

HYBRID = ModelConfig(layer_types=("full", "sliding", "full"), sliding_window=24)
SMALL = dict(num_gpu_blocks=48, max_num_batched_tokens=96, max_num_seqs=6, max_model_len=512)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny tensors: one thread is faster and immune to other processes' load.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trace():
    return mixed(5)


@pytest.fixture(scope="module")
def reference(trace):
    """Outputs of a roomy engine with prefix caching off: the ground truth."""
    cfg = EngineConfig(num_gpu_blocks=400, max_model_len=512, enable_prefix_caching=False)
    return Engine(cfg).run(trace).outputs


def _memory(**extra) -> KVConnectorConfig:
    return KVConnectorConfig(name="InMemoryConnector", module_path="_memory_connector",
                             extra_config=extra)


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(enable_prefix_caching=False), dict(max_num_batched_tokens=17),
     dict(block_size=8, num_gpu_blocks=96), dict(max_num_seqs=1)],
    ids=["prefix-cache", "no-prefix-cache", "chunk17", "block8", "one-seq"],
)
def test_outputs_identical_across_engine_settings(trace, reference, overrides):
    """Prefix caching, chunked prefill, block size and batch size never change outputs."""
    result = Engine(EngineConfig(**{**SMALL, **overrides})).run(trace)
    assert result.outputs == reference
    assert result.metrics.num_finished == len(trace)


def test_hybrid_model_with_prefix_caching_matches_without():
    """Two KV cache groups (full + sliding window): cached and recomputed runs agree."""
    trace = multi_turn_chat(2, num_users=3, turns=3, system_prompt_len=64, user_turn_len=16,
                            max_new_tokens=6, vocab=500)
    on = Engine(EngineConfig(model=HYBRID, **SMALL)).run(trace)
    off = Engine(EngineConfig(model=HYBRID, **{**SMALL, "enable_prefix_caching": False})).run(trace)
    assert on.outputs == off.outputs
    assert on.metrics.gpu_prefix_hit_tokens > 0


@pytest.mark.parametrize(
    "extra",
    [dict(), dict(load_async=True), dict(save_delay=2), dict(load_async=True, save_delay=3)],
    ids=["sync", "async", "sync-delayed-save", "async-delayed-save"],
)
def test_connector_serves_hits_and_outputs_stay_identical(trace, reference, extra):
    """With a tiny GPU pool the connector serves evicted prefixes; outputs do not change."""
    with Engine(EngineConfig(**SMALL, connector=_memory(**extra))) as engine:
        result = engine.run(trace)
        m = result.metrics
        assert result.outputs == reference
        assert m.num_finished == len(trace)  # no deadlock
        assert m.connector_hit_tokens > 0 and m.bytes_loaded > 0 and m.bytes_stored > 0
        assert m.connector_errors == {}
        # Everything was released: delayed frees completed, every block back in the pool.
        assert not engine.scheduler.delayed_free
        pool = engine.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == engine.kv_cache_config.num_blocks - 1


def test_delayed_free_holds_blocks_until_finished_sending():
    """A request whose saves are in flight keeps its blocks until finished_sending."""
    engine = Engine(EngineConfig(**SMALL, connector=_memory(save_delay=3)))
    engine.add_request(list(range(40)), 1, request_id="a")
    pool = engine.scheduler.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    finished = engine.step()  # prefill + the single output token
    assert [o.request_id for o in finished] == ["a"]
    held = free_at_start - pool.get_num_free_blocks()
    assert "a" in engine.scheduler.delayed_free and held > 0
    steps = 0
    while "a" in engine.scheduler.delayed_free:
        engine.step()
        steps += 1
        assert steps < 10
    assert steps >= 2 and pool.get_num_free_blocks() == free_at_start


def test_metrics_events_and_json(trace):
    """Metrics add up, GPU events are counted (events on), and the result round-trips JSON."""
    result = Engine(
        EngineConfig(**SMALL, connector=_memory(), enable_kv_cache_events=True)
    ).run(trace)
    m = result.metrics
    assert m.num_prompt_tokens == trace.num_prompt_tokens
    assert m.num_output_tokens == trace.num_output_tokens
    assert m.events.get("BlockStored[GPU]", 0) > 0 and m.events.get("BlockRemoved[GPU]", 0) > 0
    assert m.total_hit_rate == pytest.approx(m.gpu_hit_rate + m.connector_hit_rate)
    assert m.load_gbps > 0 and m.steps > 0
    assert msgspec.json.decode(msgspec.json.encode(result), type=RunResult) == result


def test_kv_events_are_built_only_when_consumed(trace):
    """Default: no publisher, no events - neither the pool nor the connector builds any
    (as vLLM without kv_events_config); a publisher turns them on for both."""
    from kvconnector_core.event_publisher import EventPublisherConfig

    with Engine(EngineConfig(**SMALL, connector=_memory())) as engine:
        assert engine.scheduler_connector.config.enable_kv_cache_events is False
        assert engine.worker_connector.config.enable_kv_cache_events is False
        assert engine.run(trace).metrics.events == {}
    publisher = EventPublisherConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint=None)
    config = EngineConfig(**SMALL, connector=_memory(), kv_events_publisher=publisher)
    assert config.kv_events_enabled
    with pytest.raises(ConfigError, match="enable_kv_cache_events=False; valid: True or None"):
        EngineConfig(**SMALL, kv_events_publisher=publisher, enable_kv_cache_events=False)
    with Engine(EngineConfig(**SMALL, connector=_memory(), enable_kv_cache_events=True)) as engine:
        assert engine.scheduler_connector.config.enable_kv_cache_events is True


def test_config_errors_name_the_value():
    """Bad device, too-small pool, unknown connector and foreign tokens are clear errors."""
    with pytest.raises(ConfigError, match="valid devices: cpu, cuda"):
        EngineConfig(device="tpu")
    with pytest.raises(ConfigError, match="num_gpu_blocks=4 is too small"):
        Engine(EngineConfig(num_gpu_blocks=4, max_model_len=512))
    with pytest.raises(RegistryError):
        Engine(EngineConfig(connector=KVConnectorConfig(name="no-such-connector")))
    engine = Engine(EngineConfig(**SMALL))
    with pytest.raises(ConfigError, match="outside the model vocabulary"):
        engine.add_request([1, 10**9], 2)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="torch.cuda.is_available"):
            Engine(EngineConfig(device="cuda"))


def test_arrival_is_in_engine_steps():
    """A request is added at the step its arrival names (idle gaps skipped)."""
    trace = get_workload("documents")
    engine = Engine(EngineConfig(**SMALL))
    result = engine.run(trace)
    assert result.metrics.num_finished == len(trace)
    assert result.metrics.steps >= int(trace.requests[-1].arrival) - int(trace.requests[0].arrival)


def test_per_step_sync_flag_makes_undeclared_sync_loads_correct(trace, reference):
    """A connector with sync loads but no class flag: the scheduler's per-step flag suffices."""
    result = Engine(EngineConfig(**SMALL, connector=_memory(sync_flag=False))).run(trace)
    assert result.metrics.connector_hit_tokens > 0
    assert result.outputs == reference


@pytest.mark.parametrize("extra", [dict(), dict(load_async=True)], ids=["sync", "async"])
def test_start_load_kv_raising_recomputes_and_never_deadlocks(trace, reference, extra):
    """start_load_kv fails (after scribbling on its targets): requests recompute and finish."""
    config = EngineConfig(**SMALL, connector=_memory(fail_start_load=3, **extra))
    result = Engine(config).run(trace)
    m = result.metrics
    assert m.connector_errors == {"start_load_kv": 3}
    assert m.num_finished == len(trace) and m.num_failed_loads_recovered >= 1
    assert m.connector_hit_tokens > 0  # later loads still served hits
    assert result.outputs == reference


@pytest.mark.parametrize("connector", [None, "memory", "memory-async"])
def test_prompt_token_accounting_adds_up_on_default_workload(connector):
    """computed + GPU hits + connector hits == prompt tokens; rates never exceed 100%."""
    conn = {None: None, "memory": _memory(), "memory-async": _memory(load_async=True)}[connector]
    # The `kvconnector run` defaults: a pool small enough to evict and preempt.
    config = EngineConfig(
        num_gpu_blocks=40,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        max_model_len=512,
        connector=conn,
    )
    trace = get_workload("mixed")
    m = Engine(config).run(trace).metrics
    assert m.num_finished == len(trace)
    assert m.num_prompt_tokens == trace.num_prompt_tokens
    assert (
        m.prefill_tokens_computed + m.gpu_prefix_hit_tokens + m.connector_hit_tokens
        == m.num_prompt_tokens
    )
    assert m.num_preemptions > 0 and m.recomputed_tokens > 0  # the case that overcounted
    assert 0.0 <= m.total_hit_rate <= 1.0
    assert m.total_hit_rate == pytest.approx(m.gpu_hit_rate + m.connector_hit_rate)


def test_auto_ids_never_collide_with_explicit_ids():
    """Requests without an id get ``req-<n>`` ids that skip every explicit id of the trace."""
    from kvconnector_core.engine.workloads import TraceRequest

    trace = [
        TraceRequest(arrival=0, prompt_token_ids=[1, 2, 3], max_new_tokens=2),
        TraceRequest(arrival=0, prompt_token_ids=[4, 5, 6], max_new_tokens=2, request_id="req-0"),
        TraceRequest(arrival=50, prompt_token_ids=[7, 8, 9], max_new_tokens=2, request_id="req-1"),
    ]
    result = Engine(EngineConfig(**SMALL)).run(trace)
    assert len(result.outputs) == 3 and {"req-0", "req-1"} < set(result.outputs)
    assert all(len(out) == 2 for out in result.outputs.values())
    dup = [
        *trace,
        TraceRequest(arrival=1, prompt_token_ids=[1], max_new_tokens=1, request_id="req-1"),
    ]
    with pytest.raises(ConfigError, match=r"duplicate request_id 'req-1'.*#2 and #3"):
        Engine(EngineConfig(**SMALL)).run(dup)


def test_scheduler_side_connector_stats_are_reported():
    """Stats that only the scheduler-side connector keeps (TTL pins) reach the run metrics."""
    ttl = {"name": "ttl", "extra_config": {"max_pinned_blocks": 8}}
    result = Engine(EngineConfig(connector=ttl)).run(get_workload("chat"))
    stats = result.metrics.connector_stats
    assert stats["scheduler.pins"] > 0
    assert 0 < stats["scheduler.gauges.pinned_blocks"] <= 8
