"""TTLPinConnector: the kit's contract, pinning under eviction pressure, TTL, budget, registry."""

from __future__ import annotations

import pytest

from kvconnector_core.connector import (
    KVConnectorConfig,
    KVConnectorRole,
    create_connector,
    get_registry,
)
from kvconnector_core.errors import ConfigError
from kvconnector_core.testing import (
    BLOCK_SIZE,
    ConnectorContract,
    make_kv_cache_config,
    make_kv_cache_manager,
    make_request,
)
from ttl_connector import TTLPinConnector

CONFIG = KVConnectorConfig(name="ttl", extra_config={"ttl_seconds": 10, "max_pinned_blocks": 4})


class FakeClock:
    """A settable clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TestTTLContract(ConnectorContract):
    """The kit's contract, by alias through the installed entry point."""

    connector_config = CONFIG


class TestTTLInsideMultiContract(ConnectorContract):
    """The contract again, with the TTL connector as a MultiConnector child."""

    connector_config = KVConnectorConfig(
        name="MultiConnector",
        extra_config={"connectors": [CONFIG.to_dict(), {"name": "TTLPinConnector"}]},
    )


@pytest.fixture
def env():
    """A manager with 32 blocks of 4 tokens and a TTL connector bound to its pool."""
    kvc = make_kv_cache_config(num_blocks=32)
    manager = make_kv_cache_manager(kvc)
    clock = FakeClock()
    conn = TTLPinConnector(CONFIG, KVConnectorRole.SCHEDULER, kvc, clock=clock)
    conn.bind_gpu_block_pool(manager.block_pool)
    return manager, conn, clock


def admit(manager, conn, request):
    """Admit like the scheduler: local hit, lookup, allocate, update_state_after_alloc."""
    _, local = manager.get_computed_blocks(request)
    assert conn.get_num_new_matched_tokens(request, local) == (0, False)
    blocks = manager.allocate_slots(
        request,
        request.num_tokens - local,
        local,
        manager.get_computed_blocks(request)[0] if local else None,
    )
    assert blocks is not None
    conn.update_state_after_alloc(request, manager.get_blocks(request.request_id), 0)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_tokens)
    return local


def run_and_free(manager, conn, request):
    """Admit a request, then finish it and free its blocks."""
    local = admit(manager, conn, request)
    conn.request_finished(request, manager.get_block_ids(request.request_id)[0])
    manager.free(request)
    return local


def pressure(manager, n_requests=6):
    """Allocate and free distinct prompts until every unpinned cached block is evicted."""
    for i in range(n_requests):
        r = make_request(prompt_token_ids=[10_000 + 1000 * i + t for t in range(7 * BLOCK_SIZE)])
        assert manager.allocate_slots(r, r.num_tokens) is not None
        manager.free(r)


def prefix(tag: int, blocks: int = 2):
    """A prompt of ``blocks`` full blocks plus one token, distinct per tag."""
    return [tag * 100 + t for t in range(blocks * BLOCK_SIZE + 1)]


def test_pinned_prefix_survives_eviction_that_evicts_unpinned(env):
    """A hit prefix is pinned and survives pressure; a never-hit prefix is evicted."""
    manager, conn, _ = env
    hot, cold = prefix(1), prefix(2)
    run_and_free(manager, conn, make_request(prompt_token_ids=hot))
    run_and_free(manager, conn, make_request(prompt_token_ids=cold))
    # second visit of the hot prefix: a local hit, so its blocks get pinned
    assert run_and_free(manager, conn, make_request(prompt_token_ids=hot)) == 2 * BLOCK_SIZE
    assert conn.num_pinned_blocks == 2
    pressure(manager)
    assert manager.get_computed_blocks(make_request(prompt_token_ids=hot))[1] == 2 * BLOCK_SIZE
    assert manager.get_computed_blocks(make_request(prompt_token_ids=cold))[1] == 0


def test_ttl_expires_and_releases_pins(env):
    """After the TTL without a hit, the pins are released and pressure evicts the prefix."""
    manager, conn, clock = env
    hot = prefix(3)
    run_and_free(manager, conn, make_request(prompt_token_ids=hot))
    run_and_free(manager, conn, make_request(prompt_token_ids=hot))
    assert conn.num_pinned_blocks == 2
    free_before = manager.block_pool.get_num_free_blocks()
    clock.now = 10.5
    conn.build_connector_meta(None)
    assert conn.num_pinned_blocks == 0
    assert conn.get_kv_connector_stats()["expiries"] == 2
    assert manager.block_pool.get_num_free_blocks() == free_before + 2
    pressure(manager)
    assert manager.get_computed_blocks(make_request(prompt_token_ids=hot))[1] == 0


def test_hit_refreshes_ttl(env):
    """A hit before expiry pushes the expiry out by a full TTL."""
    manager, conn, clock = env
    hot = prefix(4)
    run_and_free(manager, conn, make_request(prompt_token_ids=hot))
    run_and_free(manager, conn, make_request(prompt_token_ids=hot))  # pinned at t=0
    clock.now = 8.0
    run_and_free(manager, conn, make_request(prompt_token_ids=hot))  # refreshed: expires at 18
    clock.now = 15.0
    conn.build_connector_meta(None)
    assert conn.num_pinned_blocks == 2
    assert conn.get_kv_connector_stats()["refreshes"] == 2
    clock.now = 18.0
    conn.build_connector_meta(None)
    assert conn.num_pinned_blocks == 0


def test_budget_is_never_exceeded(env):
    """With a budget of 4 blocks, hot prefixes beyond it are refused, not pinned."""
    manager, conn, _ = env
    for tag in (5, 6, 7):
        run_and_free(manager, conn, make_request(prompt_token_ids=prefix(tag)))
        run_and_free(manager, conn, make_request(prompt_token_ids=prefix(tag)))
        assert conn.num_pinned_blocks <= 4
    stats = conn.get_kv_connector_stats()
    assert stats["gauges"] == {"pinned_blocks": 4} and stats["pins_refused"] == 2


def test_min_hits_delays_pinning():
    """With min_hits=2 a block is pinned only on its second hit."""
    kvc = make_kv_cache_config()
    manager = make_kv_cache_manager(kvc)
    cfg = KVConnectorConfig(name="ttl", extra_config={"min_hits": 2, "max_pinned_blocks": 4})
    conn = TTLPinConnector(cfg, KVConnectorRole.SCHEDULER, kvc, clock=FakeClock())
    conn.bind_gpu_block_pool(manager.block_pool)
    for expected in (0, 0, 2):
        run_and_free(manager, conn, make_request(prompt_token_ids=prefix(8)))
        assert conn.num_pinned_blocks == expected


def test_shutdown_releases_every_pin(env):
    """Shutdown unpins everything, so the blocks become free (evictable) again."""
    manager, conn, _ = env
    free_start = manager.block_pool.get_num_free_blocks()
    run_and_free(manager, conn, make_request(prompt_token_ids=prefix(9)))
    run_and_free(manager, conn, make_request(prompt_token_ids=prefix(9)))
    assert manager.block_pool.get_num_free_blocks() == free_start - 2
    conn.shutdown()
    conn.shutdown()
    assert manager.block_pool.get_num_free_blocks() == free_start


@pytest.mark.parametrize(
    "extra",
    [{"ttl_seconds": 0}, {"min_hits": 0}, {"max_pinned_blocks": -1}],
    ids=["ttl0", "minhits0", "budget-neg"],
)
def test_bad_settings_are_rejected(extra):
    """Out-of-range settings raise ConfigError naming the setting."""
    with pytest.raises(ConfigError, match=next(iter(extra))):
        TTLPinConnector(
            KVConnectorConfig(name="ttl", extra_config=extra), KVConnectorRole.SCHEDULER
        )


def test_budget_cannot_cover_the_whole_pool():
    """A budget as large as the pool is refused at bind time (when no KV cache config told it
    earlier)."""
    conn = TTLPinConnector(
        KVConnectorConfig(name="ttl", extra_config={"max_pinned_blocks": 31}),
        KVConnectorRole.SCHEDULER,
        None,
    )
    with pytest.raises(ConfigError, match="whole pool"):
        conn.bind_gpu_block_pool(make_kv_cache_manager().block_pool)


def test_created_by_name_through_registry_and_inside_multi():
    """The installed entry point makes the connector available by name, alias, and as a Multi
    child."""
    entry = get_registry().get_entry("ttl")
    assert entry.cls is TTLPinConnector and entry.distribution == "kvconnector-ttl"
    multi = create_connector(
        {"name": "MultiConnector", "extra_config": {"connectors": [{"name": "ttl"}]}},
        KVConnectorRole.SCHEDULER,
        make_kv_cache_config(),
    )
    assert isinstance(multi.children[0], TTLPinConnector)
    manager = make_kv_cache_manager()
    multi.bind_gpu_block_pool(manager.block_pool)  # forwarded to the child
    assert multi.children[0]._pool is manager.block_pool


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (
            {"ttl_seconds": "x"},
            r"TTLPinConnector: extra_config ttl_seconds='x' is not valid: Expected `float`",
        ),
        ({"min_hits": 1.5}, r"min_hits=1.5 is not valid: Expected `int`"),
        ({"max_pinned_blocks": "many"}, r"max_pinned_blocks='many' is not valid: Expected `int"),
        ({"ttl_seconds": None}, r"ttl_seconds=None is not valid"),
        (
            {"ttl_secnds": 5},
            r"unknown extra_config key 'ttl_secnds' \(did you mean 'ttl_seconds'\?\)",
        ),
    ],
    ids=["ttl-str", "hits-float", "budget-str", "ttl-none", "typo"],
)
def test_wrongly_typed_settings_name_key_value_and_valid(extra, match):
    with pytest.raises(ConfigError, match=match):
        TTLPinConnector(
            KVConnectorConfig(name="ttl", extra_config=extra), KVConnectorRole.SCHEDULER
        )


def test_budget_is_checked_against_the_kv_cache_config_at_construction():
    """max_pinned_blocks that would pin every usable block fails in __init__, naming the pool."""
    kvc = make_kv_cache_config(num_blocks=8)  # 7 usable blocks
    with pytest.raises(
        ConfigError, match=r"max_pinned_blocks=7 would pin the whole pool \(7 usable blocks\)"
    ):
        TTLPinConnector(
            KVConnectorConfig(name="ttl", extra_config={"max_pinned_blocks": 7}),
            KVConnectorRole.SCHEDULER,
            kvc,
        )
    ok = TTLPinConnector(
        KVConnectorConfig(name="ttl", extra_config={"max_pinned_blocks": 6}),
        KVConnectorRole.SCHEDULER,
        kvc,
    )
    assert ok.max_pinned_blocks == 6


class _LeakyTTL(TTLPinConnector):
    """A TTL connector whose shutdown forgets to release its pins."""

    def shutdown(self):
        pass


def test_contract_catches_pins_leaked_at_shutdown():
    """The kit's pin check fails for a connector that keeps GPU blocks pinned after shutdown."""

    class Leaky(ConnectorContract):
        connector_config = CONFIG

        def make_connector(self, role, kv_cache_config):
            return _LeakyTTL(CONFIG, role, kv_cache_config)

    with pytest.raises(AssertionError, match="GPU blocks are still pinned"):
        Leaky().test_shutdown_releases_every_gpu_pin()
    TestTTLContract().test_shutdown_releases_every_gpu_pin()  # the real one passes


def test_pins_never_starve_admission_end_to_end():
    """A budget that pins nearly the whole pool still lets every request run: idle steps release
    pins."""
    import random

    from kvconnector_core.engine.engine import Engine, EngineConfig
    from kvconnector_core.engine.workloads import TraceRequest

    rng = random.Random(0)
    shared = [rng.randrange(1000) for _ in range(192)]  # 12 blocks, all pinned after a hit
    # Many requests share a prefix (so its blocks get pinned), then one long request
    # needs most of the pool while the pins are still held (ttl far in the future).
    trace = [
        TraceRequest(
            request_id=f"s{i}",
            arrival=i,
            max_new_tokens=4,
            prompt_token_ids=shared + [rng.randrange(1000) for _ in range(8)],
        )
        for i in range(6)
    ]
    trace.append(
        TraceRequest(
            request_id="long",
            arrival=40,
            max_new_tokens=4,
            prompt_token_ids=[rng.randrange(1000) for _ in range(200)],
        )
    )
    cfg = {
        "num_gpu_blocks": 20,
        "block_size": 16,
        "max_model_len": 256,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 4,
    }
    ttl = {"name": "ttl", "extra_config": {"ttl_seconds": 1e6, "max_pinned_blocks": 18}}
    baseline = Engine(EngineConfig(connector=None, **cfg)).run(trace)
    eng = Engine(EngineConfig(connector=ttl, **cfg))
    result = eng.run(trace)
    assert result.outputs == baseline.outputs
    assert result.metrics.num_finished == len(trace)
    stats = result.metrics.connector_stats  # per-step deltas, summed by the engine
    assert stats["scheduler.pins"] > 0 and stats["scheduler.starvation_releases"] > 0


def _empty_step():
    from kvconnector_core.scheduler.output import SchedulerOutput

    return SchedulerOutput.make_empty()


def test_empty_step_after_a_finish_keeps_pins(env):
    """An empty step with no refused request (vLLM runs one after every finish) is not
    starvation."""
    manager, conn, _ = env
    run_and_free(manager, conn, make_request(prompt_token_ids=prefix(3)))
    run_and_free(manager, conn, make_request(prompt_token_ids=prefix(3)))
    assert conn.num_pinned_blocks == 2
    for _ in range(3):
        conn.build_connector_meta(_empty_step())
    assert conn.num_pinned_blocks == 2
    assert conn.get_kv_connector_stats()["starvation_releases"] == 0


def test_empty_step_that_refused_a_request_releases_pins(env):
    """A step that asked about a request, admitted nothing and scheduled nothing releases half the
    pins."""
    manager, conn, _ = env
    run_and_free(manager, conn, make_request(prompt_token_ids=prefix(3)))
    run_and_free(manager, conn, make_request(prompt_token_ids=prefix(3)))
    blocked = make_request(prompt_token_ids=prefix(4))
    assert conn.get_num_new_matched_tokens(blocked, 0) == (0, False)  # asked, never admitted
    conn.build_connector_meta(_empty_step())
    assert conn.num_pinned_blocks == 1
    conn.build_connector_meta(_empty_step())  # not asked again this step: no release
    assert conn.num_pinned_blocks == 1


def test_stats_are_deltas_with_gauges_apart(env):
    """Counters restart after each call; the pinned-blocks level is a gauge, reported every time."""
    manager, conn, _ = env
    run_and_free(manager, conn, make_request(prompt_token_ids=prefix(3)))
    run_and_free(manager, conn, make_request(prompt_token_ids=prefix(3)))
    first = conn.get_kv_connector_stats()
    assert first["pins"] == 2 and first["gauges"] == {"pinned_blocks": 2}
    second = conn.get_kv_connector_stats()
    assert second["pins"] == 0 and second["gauges"] == {"pinned_blocks": 2}


def test_pins_do_not_block_a_prefix_cache_reset():
    """The scheduler calls reset_cache before resetting the pool, so held pins no longer make it
    fail."""
    from kvconnector_core.engine.engine import Engine, EngineConfig
    from kvconnector_core.engine.workloads import TraceRequest

    shared = list(range(100, 164))
    trace = [
        TraceRequest(
            request_id=f"r{i}",
            arrival=i * 20,
            max_new_tokens=2,
            prompt_token_ids=shared + [i, i + 1],
        )
        for i in range(3)
    ]
    eng = Engine(
        EngineConfig(
            connector={"name": "ttl", "extra_config": {"ttl_seconds": 1e6}},
            num_gpu_blocks=32,
            block_size=16,
            max_model_len=256,
        )
    )
    eng.run(trace)
    ttl = eng.scheduler_connector
    assert ttl.num_pinned_blocks > 0
    assert eng.scheduler.kv_cache_manager.reset_prefix_cache() is False  # the pins hold blocks
    assert eng.reset_prefix_cache() is True
    assert ttl.num_pinned_blocks == 0
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
