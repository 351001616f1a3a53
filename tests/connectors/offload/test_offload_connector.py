"""OffloadingConnector: config, planning, events, failures, and the engine end to end."""

from __future__ import annotations

import random

import pytest
import torch

from connectors.offload.connector import OffloadingConnector, OffloadingConnectorMetadata
from connectors.offload.transfer.copy_method import CopyMethod
from connectors.offload.transfer.jobs import Job
from kvconnector_core.connector.base import KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.connector.metadata import check_metadata_roundtrip, encode_metadata
from kvconnector_core.engine.engine import Engine, EngineConfig
from kvconnector_core.engine.workloads import TraceRequest
from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from kvconnector_core.kv_events import BlockRemoved, BlockStored, to_external_hash
from kvconnector_core.plugins.registry import create_connector
from kvconnector_core.testing import FaultInjectingConnector
from kvconnector_core.testing.faults import FaultMetadata

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ],
    ),
]


def kv_config(groups: int = 1, block_size: int = 16) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=8)
    return KVCacheConfig(
        num_blocks=32,
        kv_cache_groups=[
            KVCacheGroupSpec([f"g{g}.l{i}" for i in range(2)], spec) for g in range(groups)
        ],
    )


def make(
    extra: dict, kv: KVCacheConfig | None = None, role: KVConnectorRole = KVConnectorRole.SCHEDULER
) -> OffloadingConnector:
    cfg = KVConnectorConfig(name="cpu_offload", extra_config=extra)
    return OffloadingConnector(cfg, role, kv or kv_config())


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"num_cpu_blocks": 4, "block_size": 24}, "multiple of the GPU block size 16"),
        ({"num_cpu_blocks": 4, "block_size": 32, "blocks_per_chunk": 2}, "not both"),
        ({"num_cpu_blocks": 4, "blocks_per_chunk": 0}, "blocks_per_chunk=0"),
        ({}, "num_cpu_blocks"),
        ({"num_cpu_blocks": 0}, r"num_cpu_blocks=0 is not valid: Expected `int` >= 1"),
        ({"cpu_bytes": 1}, "at least one"),
        ({"num_cpu_blocks": 4, "cache_policy": "mru"}, "unknown cache policy 'mru'"),
    ],
    ids=[
        "bad-block-size",
        "both-sizes",
        "zero-factor",
        "no-capacity",
        "zero-capacity",
        "tiny-capacity",
        "policy",
    ],
)
def test_invalid_config(extra: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make(extra)


def test_several_groups_get_per_group_geometry() -> None:
    """Hybrid models are offloaded: per group its block size, factor and window."""
    from kvconnector_core.kv_cache.kv_cache_spec import SlidingWindowSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8)
    swa = SlidingWindowSpec(block_size=8, num_kv_heads=2, head_size=8, sliding_window=64)
    kv = KVCacheConfig(
        num_blocks=32, kv_cache_groups=[KVCacheGroupSpec(["f"], full), KVCacheGroupSpec(["s"], swa)]
    )
    cfg = make({"num_cpu_blocks": 4, "block_size": 32}, kv).offload_config
    assert cfg.gpu_block_size == 16 and cfg.chunk_tokens == 32
    assert [(g.block_size, g.factor, g.window) for g in cfg.groups] == [(16, 2, 0), (8, 4, 64)]
    assert cfg.sub_blocks_per_chunk == 4
    with pytest.raises(
        ConfigError, match="block_size=24 must be a positive multiple of the GPU block size 16"
    ):
        make({"num_cpu_blocks": 4, "block_size": 24}, kv)


def test_capacity_from_bytes_and_chunk_size_from_tokens() -> None:
    kv = kv_config()
    conn = make({"cpu_bytes": 10 * 2 * kv.bytes_per_block + 5, "block_size": 32}, kv)
    assert conn.offload_config.blocks_per_chunk == 2
    assert conn.offload_config.num_cpu_blocks == 10


def test_registered_under_both_names() -> None:
    from kvconnector_core.plugins.registry import create_connector

    for name in ("OffloadingConnector", "cpu_offload"):
        conn = create_connector(
            KVConnectorConfig(name=name, extra_config={"num_cpu_blocks": 2}),
            KVConnectorRole.SCHEDULER,
            kv_config(),
        )
        assert isinstance(conn, OffloadingConnector)


# ------------------------------------------------------------------------------ engine
def doc_trace(seed: int = 0, rounds: int = 3) -> list[TraceRequest]:
    """Four 96-token documents asked about repeatedly; the GPU pool cannot keep them all."""
    rng = random.Random(seed)
    docs = [[rng.randrange(1000) for _ in range(96)] for _ in range(4)]
    return [
        TraceRequest(
            request_id=f"r{r}-{d}",
            arrival=r * 40 + d * 2,
            max_new_tokens=8,
            prompt_token_ids=doc + [rng.randrange(1000) for _ in range(5)],
        )
        for r in range(rounds)
        for d, doc in enumerate(docs)
    ]


def engine(device: str, connector: dict | None) -> Engine:
    return Engine(
        EngineConfig(
            num_gpu_blocks=24,
            block_size=16,
            max_model_len=256,
            max_num_batched_tokens=128,
            max_num_seqs=2,
            device=device,
            connector=connector,
            enable_kv_cache_events=True,
        )
    )


OFFLOAD = {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 64, "blocks_per_chunk": 2}}


def record_events(eng: Engine) -> list:
    """Capture the connector's wire events as the engine takes them."""
    seen: list = []
    conn = eng.scheduler_connector
    original = conn.take_events

    def take() -> list:
        events = original()
        seen.extend(events)
        return events

    conn.take_events = take  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["lru", "arc"], ids=["lru", "arc"])
def test_engine_serves_prefixes_from_cpu_with_identical_outputs(device: str, policy: str) -> None:
    trace = doc_trace()
    baseline = engine(device, None).run(trace)
    offload = dict(OFFLOAD, extra_config=dict(OFFLOAD["extra_config"], cache_policy=policy))
    eng = engine(device, offload)
    events = record_events(eng)
    result = eng.run(trace)
    assert result.outputs == baseline.outputs
    m = result.metrics
    assert m.connector_hit_tokens > 0  # repeated documents came back from the CPU tier
    assert m.prefill_tokens_computed < baseline.metrics.prefill_tokens_computed
    assert m.bytes_loaded > 0 and m.bytes_stored > 0 and m.connector_errors == {}
    # Wire events: self-describing, and a replay matches what the tier holds.
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and all(e.medium == "CPU" and e.block_size == 16 for e in stored)
    assert all(len(e.token_ids) == 16 * len(e.block_hashes) == 32 for e in stored)
    assert any(e.parent_block_hash is not None for e in stored)
    held: set[int] = set()
    for e in events:
        held = (
            held | set(e.block_hashes) if isinstance(e, BlockStored) else held - set(e.block_hashes)
        )
        assert isinstance(e, (BlockStored, BlockRemoved))
    manager = eng.scheduler_connector.manager
    ready = {key for key, entry in manager.policy if entry.ref_cnt >= 0}
    # Each chunk key is its last GPU block's hash plus the group, and that hash must be
    # on the wire.
    assert all(k[-4:] == bytes(4) for k in ready)
    assert {to_external_hash(k[:-4]) for k in ready} <= held
    assert len(held) == 2 * len(ready)
    eng.shutdown()


def test_failed_stores_never_become_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    real = CopyMethod.copy_host  # every job's copies on a CPU cache

    def fail_stores(self: CopyMethod, job: Job, *args: object) -> None:
        if job.is_store:
            raise RuntimeError("injected store failure")
        real(self, job, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(CopyMethod, "copy_host", fail_stores)
    trace = doc_trace(rounds=2)
    baseline = engine("cpu", None).run(trace)
    eng = engine("cpu", OFFLOAD)
    events = record_events(eng)
    result = eng.run(trace)
    assert result.outputs == baseline.outputs
    assert result.metrics.connector_hit_tokens == 0
    assert len(eng.scheduler_connector.manager.policy) == 0  # every slot given back
    assert not [e for e in events if isinstance(e, BlockStored)]
    # Nor is anything kept for their wire events (it would only grow).
    assert sum(len(t) for t in eng.scheduler_connector.scheduler_side.state.events.tables) == 0


def test_failed_loads_are_recomputed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = CopyMethod.copy_host  # every job's copies on a CPU cache

    def fail_loads(self: CopyMethod, job: Job, *args: object) -> None:
        if not job.is_store:
            raise RuntimeError("injected load failure")
        real(self, job, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(CopyMethod, "copy_host", fail_loads)
    trace = doc_trace(rounds=2)
    baseline = engine("cpu", None).run(trace)
    eng = engine("cpu", OFFLOAD)
    result = eng.run(trace)
    assert result.outputs == baseline.outputs  # recomputed, never garbage
    assert result.metrics.num_failed_loads_recovered > 0
    assert result.metrics.bytes_loaded == 0
    # Loads were unpinned after failing: everything is evictable again.
    manager = eng.scheduler_connector.manager
    assert all(entry.ref_cnt == 0 for _, entry in manager.policy)


def test_copy_thread_on_a_cpu_cache_gives_identical_outputs() -> None:
    """copy_thread on CPU: the mover's thread makes the copies, so a load must have landed
    before it is reported and a store must have read its blocks before they are reused
    (preemptions included); outputs equal the baseline's, the thread really copied."""
    import threading

    threaded = dict(OFFLOAD, extra_config=dict(OFFLOAD["extra_config"], copy_thread=True))
    trace = doc_trace()
    baseline = engine("cpu", None).run(trace)
    eng = engine("cpu", threaded)
    assert eng.worker_connector.offload_config.copy_thread is True
    assert any(t.name.startswith("kv-transfer-issue-") for t in threading.enumerate())
    result = eng.run(trace)
    eng.shutdown()
    assert result.outputs == baseline.outputs
    m = result.metrics
    assert m.connector_hit_tokens > 0 and m.bytes_loaded > 0 and m.bytes_stored > 0
    assert m.connector_errors == {}
    # Preemptions: their stores are waited for before the blocks are handed out again.
    rng = random.Random(3)
    trace = [
        TraceRequest(
            request_id=f"q{i}",
            arrival=0,
            max_new_tokens=40,
            prompt_token_ids=[rng.randrange(1000) for _ in range(70)],
        )
        for i in range(4)
    ]

    def small(connector: dict | None) -> Engine:
        return Engine(
            EngineConfig(
                num_gpu_blocks=14,
                block_size=16,
                max_model_len=128,
                max_num_batched_tokens=64,
                max_num_seqs=4,
                connector=connector,
            )
        )

    result = small(threaded).run(trace)
    assert result.metrics.num_preemptions > 0 and result.metrics.bytes_stored > 0
    assert result.outputs == small(None).run(trace).outputs


def test_preemption_flushes_stores_and_outputs_match() -> None:
    rng = random.Random(3)
    trace = [
        TraceRequest(
            request_id=f"q{i}",
            arrival=0,
            max_new_tokens=40,
            prompt_token_ids=[rng.randrange(1000) for _ in range(70)],
        )
        for i in range(4)
    ]

    def small(connector: dict | None) -> Engine:
        return Engine(
            EngineConfig(
                num_gpu_blocks=14,
                block_size=16,
                max_model_len=128,
                max_num_batched_tokens=64,
                max_num_seqs=4,
                connector=connector,
            )
        )

    baseline = small(None).run(trace)
    result = small(OFFLOAD).run(trace)
    assert result.metrics.num_preemptions > 0
    assert result.outputs == baseline.outputs


def test_metadata_survives_msgpack() -> None:
    eng = engine("cpu", OFFLOAD)
    for r in doc_trace(rounds=1)[:2]:
        eng.add_request(r.prompt_token_ids, r.max_new_tokens, request_id=r.request_id)
    metas = []
    original = eng.scheduler_connector.build_connector_meta

    def capture(so: object) -> OffloadingConnectorMetadata:
        meta = original(so)
        metas.append(meta)
        return meta

    eng.scheduler_connector.build_connector_meta = capture  # type: ignore[method-assign]
    while eng.has_unfinished_requests():
        eng.step()
    assert any(m.stores for m in metas)
    for meta in metas:
        check_metadata_roundtrip(meta)


def test_cli_run_with_cpu_offload(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvconnector run --connector cpu_offload` serves prefixes from CPU, same outputs."""
    import json

    pytest.importorskip(
        "kvconnector_core.cli.run_cmd", reason="needs the engine's `kvconnector run` command"
    )
    from kvconnector_core.cli import main

    assert main(["run", "--connector", "cpu_offload", "--json", "--kv-events"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["comparison"]["identical"] is True
    assert report["metrics"]["connector_hit_tokens"] > 0
    assert report["metrics"]["events"].get("BlockStored[CPU]", 0) > 0
    # Without --kv-events (or a publisher) nobody consumes events: none are built.
    assert main(["run", "--connector", "cpu_offload", "--json", "--no-baseline"]) == 0
    assert json.loads(capsys.readouterr().out)["metrics"]["events"] == {}


# ------------------------------------------------------------------------------ review fixes
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (
            {"num_cpu_blocks": "abc"},
            r"OffloadingConnector: extra_config num_cpu_blocks='abc' is not valid: Expected `int",
        ),
        ({"cpu_bytes": [1]}, r"cpu_bytes=\[1\] is not valid: Expected `int"),
        ({"num_cpu_blocks": 4, "blocks_per_chunk": 1.5}, r"blocks_per_chunk=1.5 is not valid"),
        ({"num_cpu_blocks": 4, "block_size": "x"}, r"block_size='x' is not valid: Expected `int"),
        ({"num_cpu_blocks": True}, r"num_cpu_blocks=True is not valid"),
        (
            {"num_cpu_blocks": 4, "enable_events": "maybe"},
            r"enable_events='maybe' is not valid: Expected `bool`",
        ),
        ({"num_cpu_blocks": 4, "cache_policy": 3}, r"cache_policy=3 is not valid: Expected `str`"),
    ],
    ids=[
        "int-str",
        "bytes-list",
        "factor-float",
        "block-size-str",
        "bool",
        "events-str",
        "policy-int",
    ],
)
def test_wrongly_typed_config_names_key_value_and_valid(extra: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make(extra)


def test_numeric_strings_are_accepted() -> None:
    conn = make({"num_cpu_blocks": "6", "blocks_per_chunk": 2.0, "enable_events": "false"})
    assert (conn.offload_config.num_cpu_blocks, conn.offload_config.blocks_per_chunk) == (6, 2)
    assert conn.offload_config.enable_events is False


def _worker(extra: dict | None = None) -> OffloadingConnector:
    from kvconnector_core.testing import make_kv_caches

    kv = kv_config()
    worker = make(extra or {"num_cpu_blocks": 8}, kv, KVConnectorRole.WORKER)
    worker.register_kv_caches(make_kv_caches(kv))
    return worker


def _run_worker_step(worker: OffloadingConnector, meta: OffloadingConnectorMetadata) -> None:
    worker.bind_connector_metadata(meta)
    worker.handle_preemptions(meta)
    worker.start_load_kv()
    worker.wait_for_save()


def test_job_completions_travel_as_worker_metadata_not_stats() -> None:
    """Finished job ids come from build_connector_worker_meta; the stats carry only numbers."""
    from connectors.offload.connector import OffloadWorkerMetadata, TransferJobSpec

    worker = _worker()
    _run_worker_step(
        worker, OffloadingConnectorMetadata(stores=[TransferJobSpec(7, "r", [1, 2], [0, 1])])
    )
    worker.clear_connector_metadata()
    _run_worker_step(worker, OffloadingConnectorMetadata())
    worker.get_transfer_results(set())
    stats = worker.get_kv_connector_stats()
    assert stats is not None and set(stats) == {"bytes_stored", "store_seconds"}
    assert worker.build_connector_worker_meta() == OffloadWorkerMetadata(done_job_ids=[7])
    assert worker.build_connector_worker_meta() is None  # reported once


def test_stores_are_submitted_when_the_next_plan_is_bound() -> None:
    """Step N's stores are submitted in step N+1's bind_connector_metadata, before its forward."""
    from connectors.offload.connector import TransferJobSpec

    worker = _worker()
    submitted: list[int] = []
    real = worker.mover.submit_store

    def spy(job_id: int, *args: object) -> None:
        submitted.append(job_id)
        real(job_id, *args)

    worker.mover.submit_store = spy  # type: ignore[method-assign]
    _run_worker_step(
        worker, OffloadingConnectorMetadata(stores=[TransferJobSpec(1, "r", [3], [0])])
    )
    worker.clear_connector_metadata()
    assert submitted == []  # never during the step that computes the blocks
    worker.bind_connector_metadata(OffloadingConnectorMetadata())
    assert submitted == [1]  # before start_load_kv / the forward of the next step


def test_completions_survive_an_exception_while_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """A poll that raises halfway loses none of the completions it already took from the mover."""
    from connectors.offload.connector import TransferJobSpec

    worker = _worker()
    jobs = [TransferJobSpec(i, f"r{i}", [i + 1], [i]) for i in range(3)]
    _run_worker_step(worker, OffloadingConnectorMetadata(stores=jobs))
    worker.clear_connector_metadata()
    _run_worker_step(worker, OffloadingConnectorMetadata())
    calls = []
    real = worker.worker_side._add_stat

    def flaky(key: str, value: float) -> None:
        calls.append(key)
        if len(calls) == 1:
            raise RuntimeError("injected")
        real(key, value)

    monkeypatch.setattr(worker.worker_side, "_add_stat", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        worker.get_transfer_results(set())
    worker.get_transfer_results(set())
    meta = worker.build_connector_worker_meta()
    assert meta is not None and sorted(meta.done_job_ids) == [0, 1, 2]


def _diverging_trace(seed: int) -> list[TraceRequest]:
    """Prompts sharing 3 blocks, diverging in the 4th (so chunk 1 of f=2 shares block 2), plus
    noise."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(1000) for _ in range(n)]  # noqa: E731
    shared = tok(48)
    prompts = [shared + tok(rng.randrange(17, 40)) for _ in range(5)] + [tok(70) for _ in range(3)]
    rng.shuffle(prompts)
    return [
        TraceRequest(
            request_id=f"d{i}",
            arrival=i * rng.randrange(1, 12),
            max_new_tokens=rng.randrange(1, 12),
            prompt_token_ids=p,
        )
        for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("seed", range(3))
def test_event_replay_is_exact_when_chunks_share_blocks(policy: str, seed: int) -> None:
    """f=2, diverging prefixes: each GPU hash is announced once while held, and a set replay
    equals the GPU blocks of the tier's ready chunks."""
    from kvconnector_core.request import Request

    trace = _diverging_trace(seed)
    eng = Engine(
        EngineConfig(
            num_gpu_blocks=24,
            block_size=16,
            max_model_len=256,
            connector={
                "name": "cpu_offload",
                "extra_config": {
                    "num_cpu_blocks": 5,
                    "blocks_per_chunk": 2,
                    "cache_policy": policy,
                },
            },
            enable_kv_cache_events=True,
        )
    )
    events = record_events(eng)
    result = eng.run(trace)
    held: set[int] = set()
    for e in events:
        if isinstance(e, BlockStored):
            assert not held & set(e.block_hashes), "a held GPU block was announced again"
            assert len(e.token_ids) == 16 * len(e.block_hashes)
            held |= set(e.block_hashes)
        else:
            assert set(e.block_hashes) <= held, "removal of a GPU block not held"
            held -= set(e.block_hashes)
    chunk_blocks: dict[bytes, list[bytes]] = {}
    for r in trace:
        hashes = Request(
            "x", r.prompt_token_ids + result.outputs[r.request_id], 1, hash_block_size=16
        ).block_hashes
        for i in range(len(hashes) // 2):
            chunk_blocks[hashes[2 * i + 1]] = hashes[2 * i : 2 * i + 2]
    ready = [k for k, entry in eng.scheduler_connector.manager.policy if entry.ref_cnt >= 0]
    assert held == {to_external_hash(h) for k in ready for h in chunk_blocks[k[:-4]]}
    eng.shutdown()


def test_no_chunk_info_is_kept_without_events() -> None:
    """With enable_events=False nothing drains the chunk table, so nothing is put in it."""
    rng = random.Random(0)
    trace = [
        TraceRequest(
            request_id=f"q{i}",
            arrival=i,
            max_new_tokens=2,
            prompt_token_ids=[rng.randrange(1000) for _ in range(64)],
        )
        for i in range(12)
    ]
    eng = engine(
        "cpu",
        {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 4, "enable_events": False}},
    )
    result = eng.run(trace)
    assert result.metrics.bytes_stored > 0
    assert sum(len(t) for t in eng.scheduler_connector.scheduler_side.state.events.tables) == 0
    assert list(eng.scheduler_connector.take_events()) == []


def test_no_chunk_info_is_kept_when_the_engine_consumes_no_events() -> None:
    """The engine's default (no publisher): the connector config says nobody consumes KV
    events, so the CPU tier builds none although extra_config leaves enable_events on;
    MultiConnector's children inherit the setting."""
    rng = random.Random(0)
    trace = [
        TraceRequest(
            request_id=f"q{i}",
            arrival=i,
            max_new_tokens=2,
            prompt_token_ids=[rng.randrange(1000) for _ in range(64)],
        )
        for i in range(12)
    ]
    eng = Engine(
        EngineConfig(
            num_gpu_blocks=24,
            block_size=16,
            max_model_len=256,
            max_num_batched_tokens=128,
            max_num_seqs=2,
            connector={"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 4}},
        )
    )
    assert eng.scheduler_connector.offload_config.enable_events is False
    result = eng.run(trace)
    assert result.metrics.bytes_stored > 0 and result.metrics.events == {}
    assert sum(len(t) for t in eng.scheduler_connector.scheduler_side.state.events.tables) == 0
    eng.shutdown()
    multi = KVConnectorConfig(
        name="MultiConnector",
        enable_kv_cache_events=False,
        extra_config={
            "connectors": [{"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 4}}]
        },
    )
    conn = create_connector(multi, KVConnectorRole.SCHEDULER, kv_config())
    assert conn.children[0].offload_config.enable_events is False
    assert make({"num_cpu_blocks": 4}).offload_config.enable_events is True  # built alone: on


def test_arc_does_not_promote_a_requests_own_chunks() -> None:
    """One request and no reuse: its chunks are seen once, so ARC keeps them all in T1."""
    rng = random.Random(0)
    eng = Engine(
        EngineConfig(
            num_gpu_blocks=40,
            block_size=16,
            max_model_len=512,
            connector={
                "name": "cpu_offload",
                "extra_config": {"num_cpu_blocks": 64, "cache_policy": "arc"},
            },
        )
    )
    prompt = [rng.randrange(1000) for _ in range(100)]
    eng.add_request(prompt, 60, request_id="only")
    while eng.has_unfinished_requests():
        eng.step()
    policy = eng.scheduler_connector.manager.policy
    assert len(policy.t1) > 1 and len(policy.t2) == 0
    # A real hit (a second request reusing the prompt) does promote the chunks it hits.
    eng.add_request(prompt, 1, request_id="again")
    while eng.has_unfinished_requests():
        eng.step()
    assert len(policy.t2) >= 100 // 16 - 1
    eng.shutdown()


def test_recency_of_hit_chunks_is_recorded_when_the_request_finishes() -> None:
    """As in vLLM 0.33, a request's hits are touched after its stores, at finish: while
    it runs its GPU-hit chunks stay where they were (ARC: T1); then they move to T2."""
    rng = random.Random(1)
    eng = Engine(
        EngineConfig(
            num_gpu_blocks=40,
            block_size=16,
            max_model_len=512,
            connector={
                "name": "cpu_offload",
                "extra_config": {"num_cpu_blocks": 64, "cache_policy": "arc"},
            },
        )
    )
    prompt = [rng.randrange(1000) for _ in range(100)]
    eng.add_request(prompt, 4, request_id="first")
    while eng.has_unfinished_requests():
        eng.step()
    policy = eng.scheduler_connector.manager.policy
    assert len(policy.t2) == 0
    eng.add_request(prompt + [1, 2, 3], 8, request_id="again")  # a GPU prefix hit
    eng.step()
    assert eng.has_unfinished_requests() and len(policy.t2) == 0
    while eng.has_unfinished_requests():
        eng.step()
    assert len(policy.t2) == 100 // 16
    eng.shutdown()


# ------------------------------------------------------------------------------ contract
from kvconnector_core.testing import ConnectorContract  # noqa: E402


class TestOffloadingContract(ConnectorContract):
    """Every built-in passes the kit's contract (delayed free and pin checks included)."""

    connector_config = KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 8})


class TestOffloadingChunkedContract(ConnectorContract):
    """The contract with two GPU blocks per offloaded chunk."""

    connector_config = KVConnectorConfig(
        name="cpu_offload", extra_config={"num_cpu_blocks": 8, "blocks_per_chunk": 2}
    )


def test_transfer_method_is_validated_with_the_config():
    """A bad transfer_method is a ConfigError naming the valid methods when the connector is
    built."""
    from connectors.offload import connector as offload_connector
    from connectors.offload.transfer.mover import METHODS

    assert offload_connector.TRANSFER_METHODS == METHODS
    with pytest.raises(
        ConfigError,
        match="transfer_method='xx'.*auto, pitched, batched, coalesced, per_block, gather",
    ):
        make({"num_cpu_blocks": 8, "transfer_method": "xx"})


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_role_limits_the_connector_to_its_direction(role):
    """A kv_producer never loads and a kv_consumer never stores."""
    from kvconnector_core.engine.workloads import get_workload

    trace = get_workload("documents")
    cfg = {"name": "cpu_offload", "role": role, "extra_config": {"num_cpu_blocks": 256}}
    m = Engine(EngineConfig(connector=cfg)).run(trace).metrics
    if role == "kv_producer":
        assert m.bytes_stored > 0 and m.bytes_loaded == 0 and m.connector_hit_tokens == 0
    else:
        assert m.bytes_stored == 0 and m.bytes_loaded == 0


def test_failed_start_load_unpins_the_cpu_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """If start_load_kv raises before submitting, the failed receive still unpins the loaded
    chunks."""
    calls = {"n": 0}
    original = OffloadingConnector.start_load_kv

    def flaky(self, forward_context=None):
        if self.worker_side.plan.loads and calls["n"] == 0:
            calls["n"] += 1
            raise RuntimeError("injected: start_load_kv failed")
        return original(self, forward_context)

    monkeypatch.setattr(OffloadingConnector, "start_load_kv", flaky)
    prompt = list(range(1, 50))
    trace = [
        TraceRequest(arrival=0, prompt_token_ids=prompt, max_new_tokens=2, request_id="a"),
        TraceRequest(arrival=20, prompt_token_ids=prompt, max_new_tokens=2, request_id="b"),
    ]
    cfg = {"name": "cpu_offload", "extra_config": {"num_cpu_blocks": 8}}
    eng = Engine(
        EngineConfig(
            connector=cfg, num_gpu_blocks=64, max_model_len=256, enable_prefix_caching=False
        )
    )
    result = eng.run(trace)
    assert calls["n"] == 1 and result.metrics.num_finished == 2
    conn = eng.scheduler_connector
    # every planned job completed, the failed load included
    assert not conn.scheduler_side.state.jobs
    assert all(entry.ref_cnt == 0 for _, entry in conn.manager.policy)  # nothing left pinned


def test_fault_wrapper_forwards_worker_metadata_and_preemptions() -> None:
    """A FaultInjectingConnector with no faults passes job completions and preemption flushes
    through."""
    worker = OffloadingConnector(
        KVConnectorConfig(name="cpu_offload", extra_config={"num_cpu_blocks": 4}),
        KVConnectorRole.WORKER,
        kv_config(),
    )
    wrapped = FaultInjectingConnector(worker)
    sentinel = object()
    worker.build_connector_worker_meta = lambda: sentinel
    seen = []
    worker.handle_preemptions = seen.append
    assert wrapped.build_connector_worker_meta() is sentinel
    inner_meta = OffloadingConnectorMetadata()
    wrapped.handle_preemptions(FaultMetadata(inner=encode_metadata(inner_meta)))
    assert len(seen) == 1 and isinstance(seen[0], OffloadingConnectorMetadata)


def test_scheduler_side_stats_are_none_not_an_error():
    """The engine asks the scheduler role for stats: None, not an error (and a traceback)."""
    assert make({"num_cpu_blocks": 8}).get_kv_connector_stats() is None


@pytest.mark.parametrize("factor", [1, 2])
def test_one_group_lookup_fast_path_matches_longest_hit(factor: int) -> None:
    """The one-full-group lookup (no key function per chunk) answers what the general
    longest_hit answers, for random held chunks, local hits and prompt lengths."""
    import types

    rng = random.Random(factor)
    side = make({"num_cpu_blocks": 64, "blocks_per_chunk": factor}).scheduler_side
    hashes = [rng.randbytes(8) for _ in range(40)]
    ct = 16 * factor
    held = [
        side.keys.key(types.SimpleNamespace(block_hashes=hashes), 0, c)  # noqa: SLF001
        for c in range(len(hashes) // factor)
        if rng.random() < 0.8
    ]
    side.manager.complete_store(side.manager.prepare_store(held).keys_to_store)
    for i in range(200):
        n = rng.randrange(1, 41)
        req = types.SimpleNamespace(
            request_id=f"r{i}", block_hashes=hashes[:n], num_tokens=n * 16 + rng.randrange(0, 16)
        )
        computed = rng.randrange(0, n + 1) * 16 // ct * ct
        fast = side.get_num_new_matched_tokens(req, computed)
        side.keys.one_full_group = False  # noqa: SLF001 - the general path
        general = side.get_num_new_matched_tokens(req, computed)
        side.keys.one_full_group = True  # noqa: SLF001
        assert fast == general, (n, computed)


def test_a_waiting_requests_hit_is_reused_until_the_tier_changes() -> None:
    """A request asked again (it could not be admitted) gets its last answer without a
    lookup while the tier is unchanged; a completed store, an eviction or more tokens
    make the scheduler side look again, so a cached hit is never stale."""
    import types

    side = make({"num_cpu_blocks": 4}).scheduler_side
    hashes = [bytes([i]) * 8 for i in range(6)]
    key = [side.keys.key(types.SimpleNamespace(block_hashes=hashes), 0, c) for c in range(6)]  # noqa: SLF001
    req = types.SimpleNamespace(request_id="r", block_hashes=hashes, num_tokens=6 * 16 + 1)
    calls = []
    lookup = side.manager.lookup
    side.manager.lookup = lambda keys: calls.append(1) or lookup(keys)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side.get_num_new_matched_tokens(req, 0) == (0, False) and len(calls) == 1
    side.manager.complete_store(side.manager.prepare_store(key[:3]).keys_to_store)  # stored
    assert side.get_num_new_matched_tokens(req, 0) == (48, True) and len(calls) == 2
    assert side.get_num_new_matched_tokens(req, 0) == (48, True) and len(calls) == 2
    # other local hit
    assert side.get_num_new_matched_tokens(req, 16) == (32, True) and len(calls) == 3
    side.manager.prepare_store([bytes([9]) * 12, bytes([10]) * 12])  # full: evicts the LRU key[0]
    assert side.get_num_new_matched_tokens(req, 0) == (0, False) and len(calls) == 4
    longer = types.SimpleNamespace(
        request_id="r", block_hashes=hashes + [b"x" * 8], num_tokens=7 * 16 + 1
    )
    side.get_num_new_matched_tokens(longer, 0)
    assert len(calls) == 5
