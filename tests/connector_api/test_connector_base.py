"""The connector base class, boundary records, and the test kit (contract, faults)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconnector_core.connector import (
    ABSTRACT_HOOKS,
    OPTIONAL_HOOKS,
    ConnectorRegistry,
    KVConnectorBase,
    KVConnectorBase_V1,
    KVConnectorConfig,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    check_metadata_roundtrip,
)
from kvconnector_core.errors import ConfigError, InvariantError
from kvconnector_core.kv_events import BlockRemoved, BlockStored
from kvconnector_core.testing import (
    ConnectorContract,
    FaultInjectingConnector,
    InjectedFault,
    RecordingConnector,
    empty_scheduler_output,
    make_block_pool,
    make_kv_cache_config,
    make_kv_cache_manager,
    make_request,
)

REC = KVConnectorConfig(name="RecordingConnector", module_path="kvconnector_core.testing.recording")


class Minimal(KVConnectorBase_V1):
    """Implements only the seven abstract hooks."""

    name = "Minimal"

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context=None):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata=None):
        pass

    def wait_for_save(self):
        pass


class TestRecordingContract(ConnectorContract):
    """The kit's own test double passes the contract."""

    connector_config = REC


class TestMinimalContract(ConnectorContract):
    """A connector implementing only the abstract hooks passes the contract (defaults suffice)."""

    connector_config = KVConnectorConfig(name="Minimal")
    registry = ConnectorRegistry()
    registry.add(Minimal)


def test_seven_abstract_hooks():
    """Exactly the reference's seven hooks are abstract; KVConnectorBase is the same class."""
    assert KVConnectorBase is KVConnectorBase_V1
    assert KVConnectorBase_V1.__abstractmethods__ == frozenset(ABSTRACT_HOOKS)
    assert len(ABSTRACT_HOOKS) == 7
    missing = type("Missing", (KVConnectorBase_V1,), {"name": "m"})
    with pytest.raises(TypeError, match="abstract"):
        missing(REC, KVConnectorRole.SCHEDULER)


def test_capability_defaults():
    """A connector that declares nothing loads synchronously, gets the per-layer hooks,
    needs no block pool and handles one KV cache group (the documented defaults)."""
    caps = ("supports_async_load", "has_sync_kv_loads", "uses_layer_hooks", "requires_block_pool",
            "supports_multiple_kv_cache_groups", "required_kv_cache_layout")
    assert {c: getattr(Minimal, c) for c in caps} == {
        "supports_async_load": False, "has_sync_kv_loads": False, "uses_layer_hooks": True,
        "requires_block_pool": False, "supports_multiple_kv_cache_groups": False,
        "required_kv_cache_layout": None}


def test_optional_hook_defaults():
    """Every optional hook has a documented no-op default."""
    conn = Minimal(KVConnectorConfig(name="Minimal"), KVConnectorRole.SCHEDULER)
    assert conn.request_finished(make_request(), [1, 2]) == (False, None)
    assert list(conn.take_events()) == []
    assert conn.get_finished({"a"}) == (None, None)
    assert conn.get_block_ids_with_load_errors() == set()
    assert conn.get_kv_connector_stats() is None
    assert conn.bind_gpu_block_pool(make_block_pool()) is None
    assert conn.update_connector_output(KVConnectorOutput()) is None
    assert conn.register_kv_caches({}) is None
    conn.shutdown()
    res = conn.get_transfer_results(set())
    assert not (res.finished_sending or res.finished_recving or res.failed_recving)
    for hook in OPTIONAL_HOOKS:
        assert callable(getattr(conn, hook)), hook


def test_constructor_validates_config_and_role():
    """A dict config or a bad role is a ConfigError naming it."""
    with pytest.raises(ConfigError, match="KVConnectorConfig"):
        Minimal({"name": "Minimal"}, KVConnectorRole.WORKER)
    with pytest.raises(ConfigError, match="role"):
        Minimal(KVConnectorConfig(name="Minimal"), 7)
    conn = Minimal(KVConnectorConfig(name="Minimal"), 1)
    assert conn.role is KVConnectorRole.WORKER


def test_metadata_binding_lifecycle():
    """Worker metadata binds, is readable, clears; reading unbound metadata is a clear error."""
    conn = Minimal(KVConnectorConfig(name="Minimal"), KVConnectorRole.WORKER)
    assert not conn.has_connector_metadata()
    with pytest.raises(InvariantError, match="bind_connector_metadata"):
        conn._get_connector_metadata()
    meta = KVConnectorMetadata()
    conn.bind_connector_metadata(meta)
    assert conn.has_connector_metadata() and conn._get_connector_metadata() is meta
    conn.clear_connector_metadata()
    assert not conn.has_connector_metadata()


def test_bind_kv_cache_manager_binds_pool_once():
    """The vLLM-style manager binding forwards the manager's pool to bind_gpu_block_pool once."""
    manager = make_kv_cache_manager()
    conn = RecordingConnector(REC, KVConnectorRole.SCHEDULER)
    conn.bind_kv_cache_manager(manager)
    assert conn.hooks_called() == ["bind_gpu_block_pool"]
    assert conn.block_pool is manager.block_pool


class Plan(KVConnectorMetadata):
    """A metadata subclass with containers."""

    loads: dict[str, list[int]] = msgspec.field(default_factory=dict)
    flags: set[str] = msgspec.field(default_factory=set)


@given(
    st.dictionaries(st.text(max_size=5), st.lists(st.integers(0, 2**31), max_size=5), max_size=5),
    st.sets(st.text(max_size=3), max_size=4),
)
def test_metadata_roundtrip_property(loads, flags):
    """Any Plan survives the msgpack round trip unchanged."""
    meta = Plan(loads=loads, flags=flags)
    assert check_metadata_roundtrip(meta) == meta


def test_metadata_roundtrip_rejects_bad_metadata():
    """Non-metadata and metadata that changes across msgpack are rejected with TypeError."""
    with pytest.raises(TypeError, match="KVConnectorMetadata"):
        check_metadata_roundtrip({"a": 1})

    class Lossy(KVConnectorMetadata):
        value: object = None

    with pytest.raises(TypeError, match="Lossy"):
        check_metadata_roundtrip(Lossy(value=(1, 2)))  # a tuple comes back as a list


def test_connector_output_roundtrips_with_events():
    """KVConnectorOutput, events included, survives msgpack; is_empty reflects content."""
    out = KVConnectorOutput(
        finished_sending={"a"},
        finished_recving={"b", "c"},
        failed_recving={"c"},
        invalid_block_ids={3, 4},
        kv_connector_stats={"bytes_loaded": 10},
        kv_cache_events=[
            BlockStored([1], None, [1, 2], 2, None, "CPU", None),
            BlockRemoved([1], "CPU"),
        ],
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=KVConnectorOutput)
    assert back == out and isinstance(back.kv_cache_events[1], BlockRemoved)
    assert KVConnectorOutput().is_empty() and not out.is_empty()


# ---------------------------------------------------------------- fault injection


def _admit(sched, manager, request, ext_expected):
    _, local = manager.get_computed_blocks(request)
    n, _ = sched.get_num_new_matched_tokens(request, local)
    assert n == ext_expected
    assert (
        manager.allocate_slots(request, request.num_tokens - n, num_external_computed_tokens=n)
        is not None
    )
    sched.update_state_after_alloc(request, manager.get_blocks(request.request_id), n)


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_fault_injection_fails_loads(load_async):
    """With rate 1 every planned load is reported failed: blocks invalid, async ones as failed
    receives."""
    kvc = make_kv_cache_config()
    cfg = KVConnectorConfig(
        name="RecordingConnector",
        module_path=REC.module_path,
        extra_config={"hit_tokens": 8, "load_async": load_async},
    )
    sched = FaultInjectingConnector(
        RecordingConnector(cfg, KVConnectorRole.SCHEDULER, kvc), load_failure_rate=1.0
    )
    worker = FaultInjectingConnector(
        RecordingConnector(cfg, KVConnectorRole.WORKER, kvc), load_failure_rate=1.0
    )
    manager = make_kv_cache_manager(kvc)
    request = make_request(13)
    _admit(sched, manager, request, 8)
    meta = check_metadata_roundtrip(sched.build_connector_meta(empty_scheduler_output()))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    worker.wait_for_save()
    res = worker.get_transfer_results(set())
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    assert errors == set(manager.get_block_ids(request.request_id)[0][:2])
    if load_async:
        assert res.finished_recving == res.failed_recving == {request.request_id}
    else:
        assert not res.finished_recving and not res.failed_recving
    assert worker.get_block_ids_with_load_errors() == set()  # reported once


def test_fault_injection_rate_zero_passes_through_and_is_seeded():
    """Rate 0 injects nothing; the same seed gives the same fault pattern."""

    def pattern(seed, rate=0.5):
        kvc = make_kv_cache_config(num_blocks=64)
        cfg = KVConnectorConfig(name="RecordingConnector", extra_config={"hit_tokens": 4})
        sched = FaultInjectingConnector(
            RecordingConnector(cfg, KVConnectorRole.SCHEDULER, kvc),
            load_failure_rate=rate,
            seed=seed,
        )
        manager = make_kv_cache_manager(kvc)
        for i in range(10):
            request = make_request(
                prompt_token_ids=[1000 * i + t for t in range(9)], request_id=f"r{i}"
            )
            _admit(sched, manager, request, 4)
        return sorted(sched.build_connector_meta(empty_scheduler_output()).failed_loads)

    assert pattern(1, rate=0.0) == []
    assert pattern(1) == pattern(1)
    assert 0 < len(pattern(1)) < 10
    assert pattern(1) != pattern(2) or pattern(1) != pattern(3)


def test_fault_injection_raises_and_fails_stores():
    """raise_in hooks raise InjectedFault; a store failure raises from wait_for_save after the inner
    ran."""
    cfg = KVConnectorConfig(name="RecordingConnector")
    sched = FaultInjectingConnector(
        RecordingConnector(cfg, KVConnectorRole.SCHEDULER),
        raise_in={"get_num_new_matched_tokens"},
        store_failure_rate=1.0,
    )
    with pytest.raises(InjectedFault):
        sched.get_num_new_matched_tokens(make_request(), 0)
    inner_worker = RecordingConnector(cfg, KVConnectorRole.WORKER)
    worker = FaultInjectingConnector(inner_worker, store_failure_rate=1.0)
    worker.bind_connector_metadata(sched.build_connector_meta(empty_scheduler_output()))
    worker.save_kv_layer("layer.0", None)
    with pytest.raises(InjectedFault, match="store"):
        worker.wait_for_save()
    # The inner bookkeeping still runs (skipping it leaked delayed frees); the hook then raises.
    assert {"save_kv_layer", "wait_for_save"} <= set(inner_worker.hooks_called())
    assert worker.get_kv_connector_stats()["injected_faults"]["stores"] == 1
    with pytest.raises(ConfigError, match="unknown hooks"):
        FaultInjectingConnector(inner_worker, raise_in={"nope"})
    with pytest.raises(ConfigError, match="load_failure_rate"):
        FaultInjectingConnector(inner_worker, load_failure_rate=2)
