"""Secondary tiers under tensor / pipeline parallelism: every worker keeps its own shard.

Each rank writes and reads only the keys of its shard (``-r<rank>of<tp>x<pp>``), the
scheduler side counts a chunk as held only when every rank's shard is, and a shard that
vanishes between lookup and load is a failed load (recomputed), never another rank's
bytes. End to end, ``_tp_engine`` runs N workers whose models differ per rank (so their KV
bytes differ, as shards do): each rank's samples must match a run without a connector.
"""

from __future__ import annotations

import zlib

import msgspec
import pytest
import torch
from _redis_servers import redis_single, require_redis_server  # noqa: F401 - fixtures
from _tp_engine import tp_engine

from connectors.multi import MultiConnector
from connectors.offload.connector import OffloadingConnector
from connectors.offload.records import TierRead, TierWrite
from connectors.offload.tiers import DiskTier, RedisTier, Shard, TierKey
from connectors.offload.tiers.frame import HEADER_BYTES, frame_value, unframe_value
from connectors.offload.tiers.records import tier_key
from connectors.offload.tiers.scheduler import TierLookups
from connectors.offload.tiers.worker import WorkerTiers
from kvconnector_core.connector.base import KVConnectorRole
from kvconnector_core.connector.config import KVConnectorConfig
from kvconnector_core.engine.engine import EngineConfig
from kvconnector_core.errors import ConfigError
from kvconnector_core.kv_cache.hashing import BlockHash
from kvconnector_core.plugins.registry import create_connector
from kvconnector_core.testing.faults import fault_injection_config
from tests.connectors.offload.test_offload_tiering import _poll
from test_tiers_engine import ENGINE, doc_trace, offload

HASH = BlockHash(bytes(range(32)))


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------ keys
def test_a_key_names_its_shard_and_parses_back():
    key = TierKey(HASH, 1, Shard(3, 8, 2))
    assert key.name == f"{HASH.hex()}-g1-r3of4x2"  # rank 3 of TP 4 x PP 2
    assert TierKey.from_name(key.name) == key
    assert TierKey.from_name(f"{HASH.hex()}-g0") == TierKey(HASH, 0)
    with pytest.raises(ValueError, match="not a tier key name"):
        TierKey.from_name("notes.txt")


def test_shards_of_other_layouts_have_other_names():
    names = {TierKey(HASH, 0, Shard(1, 2)).name, TierKey(HASH, 0, Shard(1, 4)).name,
             TierKey(HASH, 0, Shard(1, 4, 2)).name, TierKey(HASH, 0).name}
    assert len(names) == 4
    assert Shard.all_of(1) == [None]
    assert Shard.all_of(4, 2) == [Shard(r, 4, 2) for r in range(4)]


def test_one_worker_keys_and_frames_are_those_before_shards():
    """World size 1 keeps the documented format: files and values written before shards
    existed are still served."""
    key = TierKey(HASH, 2)
    assert key.name == f"{HASH.hex()}-g2"
    payload = b"kv bytes" * 10
    crc = zlib.crc32(payload, zlib.crc32((2).to_bytes(4, "big"), zlib.crc32(HASH)))
    assert (
        frame_value(key, payload)
        == b"KVT1" + len(payload).to_bytes(8, "big") + crc.to_bytes(4, "big") + payload
    )


def test_a_shard_stored_under_another_ranks_key_fails_its_check():
    value = frame_value(TierKey(HASH, 0, Shard(0, 2)), b"rank zero's heads")
    assert unframe_value(TierKey(HASH, 0, Shard(0, 2)), value) == b"rank zero's heads"
    assert unframe_value(TierKey(HASH, 0, Shard(1, 2)), value) is None
    assert unframe_value(TierKey(HASH, 0), value) is None


def test_rank_and_pipeline_size_are_validated():
    with pytest.raises(ConfigError, match=r"rank must be a worker rank in \[0, 2\).*got 2"):
        KVConnectorConfig(name="cpu_offload", world_size=2, rank=2)
    with pytest.raises(
        ConfigError, match="pipeline_parallel_size must be >= 1 and divide world_size=4, got 3"
    ):
        KVConnectorConfig(name="cpu_offload", world_size=4, pipeline_parallel_size=3)


def _disk_extra(tmp_path) -> dict:
    return {
        "num_cpu_blocks": 8,
        "tiers": [{"type": "disk", "path": str(tmp_path / "t"), "capacity_bytes": 1 << 20}],
    }


def test_offload_with_tiers_under_tp_gives_each_worker_its_shard(tmp_path):
    """The ConfigError refusal is gone: a worker of rank r keys its values by r."""
    kv = EngineConfig(num_gpu_blocks=64, max_model_len=256).kv_cache_config()
    config = KVConnectorConfig(
        name="cpu_offload",
        extra_config=_disk_extra(tmp_path),
        world_size=4,
        rank=3,
        pipeline_parallel_size=2,
    )
    worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv)
    sched = OffloadingConnector(config, KVConnectorRole.SCHEDULER, kv)
    try:
        assert worker.worker_side.tiers.shard == Shard(3, 4, 2)
        assert sched.scheduler_side.tiers.lookups.shards == tuple(Shard(r, 4, 2) for r in range(4))
    finally:
        worker.shutdown()
        sched.shutdown()


def test_multiconnector_children_inherit_rank_and_pipeline_size(tmp_path):
    kv = EngineConfig(num_gpu_blocks=64, max_model_len=256).kv_cache_config()
    config = KVConnectorConfig(
        name="MultiConnector",
        world_size=4,
        rank=2,
        pipeline_parallel_size=2,
        extra_config={
            "connectors": [{"name": "cpu_offload", "extra_config": _disk_extra(tmp_path)}]
        },
    )
    multi = MultiConnector(config, KVConnectorRole.WORKER, kv)
    try:
        child = multi.worker_side.guards[0].connector
        assert (
            child.config.world_size,
            child.config.rank,
            child.config.pipeline_parallel_size,
        ) == (4, 2, 2)
        assert child.worker_side.tiers.shard == Shard(2, 4, 2)
    finally:
        multi.shutdown()


def test_fault_wrapped_offload_runs_as_the_worker_the_engine_built(tmp_path):
    """The kit's FaultInjector gives the connector it wraps the world size and rank the
    engine set on the wrapper (vLLM's adapter sets them per worker): its tier keys name
    its shard and its scheduler side looks up every rank's."""
    kv = EngineConfig(num_gpu_blocks=64, max_model_len=256).kv_cache_config()
    wrapped = fault_injection_config({"name": "cpu_offload", "extra_config": _disk_extra(tmp_path)})
    config = msgspec.structs.replace(wrapped, world_size=4, rank=3, pipeline_parallel_size=2)
    worker = create_connector(config, KVConnectorRole.WORKER, kv)
    sched = create_connector(config, KVConnectorRole.SCHEDULER, kv)
    try:
        assert worker.inner.worker_side.tiers.shard == Shard(3, 4, 2)
        assert sched.inner.scheduler_side.tiers.lookups.shards == tuple(
            Shard(r, 4, 2) for r in range(4)
        )
    finally:
        worker.shutdown()
        sched.shutdown()


# --------------------------------------------------------------- lookups and bytes
def _okeys(n):
    return [bytes([i + 1]) * 32 + (0).to_bytes(4, "big") for i in range(n)]


def _make_tier(kind, tmp_path, request):
    if kind == "disk":
        return lambda: DiskTier({"path": str(tmp_path / "shared"), "capacity_bytes": 1 << 20})
    node = request.getfixturevalue("redis_single")
    return lambda: RedisTier({"url": node.url, "model": "tp-test", "layout": "l"})


@pytest.mark.parametrize("kind", ["disk", pytest.param("redis", marks=pytest.mark.redis)])
def test_a_chunk_is_held_only_when_every_ranks_shard_is(kind, tmp_path, request):
    new_tier = _make_tier(kind, tmp_path, request)
    writer = new_tier()
    keys = _okeys(3)
    shards = Shard.all_of(2)
    # chunk 0: both shards; chunk 1: rank 0's only; chunk 2: rank 1's only
    writer.store(
        [(tier_key(keys[0], s), b"x") for s in shards]
        + [(tier_key(keys[1], shards[0]), b"x"), (tier_key(keys[2], shards[1]), b"x")]
    )
    assert writer.flush(30)
    writer.close()
    tier = new_tier()
    lookups = TierLookups([tier], shards)
    assert _poll(lambda: lookups.sources("r", keys)) == [0, None, None]
    # every shard of every chunk in one lookup (one EXISTS pipeline on Redis)
    assert tier.stats()[f"{tier.medium.lower()}_lookups"] == 1
    # one worker's keys are not a TP worker's: nothing is held for world size 1
    alone = TierLookups([tier])
    assert _poll(lambda: alone.sources("s", keys)) == [None, None, None]
    lookups.close()


def _planes(rank):
    """A rank's CPU buffer: two planes (K and V, say) of 4 slots, bytes unique to the rank."""
    return (
        torch.arange(4 * 6, dtype=torch.uint8).view(4, 6) + 50 * rank,
        torch.arange(4 * 5, dtype=torch.uint8).view(4, 5) + 7 + 50 * rank,
    )


@pytest.mark.parametrize("kind", ["disk", pytest.param("redis", marks=pytest.mark.redis)])
@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_loads_back_its_own_bytes(kind, world_size, tmp_path, request):
    """Ranks share one directory / one Redis, write the same chunks at once, and each
    reads back exactly the bytes it wrote."""
    new_tier = _make_tier(kind, tmp_path, request)
    keys = _okeys(2)
    workers, planes = [], []
    for rank in range(world_size):
        worker = WorkerTiers([new_tier()], shard=Shard(rank, world_size))
        planes.append(_planes(rank))
        worker.bind_buffer(planes[-1])
        worker.write(
            [
                TierWrite(keys[0], [1], [keys[0][:-4]], None),
                TierWrite(keys[1], [2], [keys[1][:-4]], None),
            ]
        )
        workers.append(worker)
    for worker in workers:
        assert worker.tiers[0].flush(30)
    for rank, worker in enumerate(workers):
        want = [p.clone() for p in planes[rank]]
        for p in planes[rank]:
            p[0].zero_()
            p[3].zero_()
        worker.start_reads(7, [TierRead(0, keys[0], [0]), TierRead(0, keys[1], [3])])
        assert _poll(worker.finished_reads) == [(7, True)]
        for got, orig in zip(planes[rank], want, strict=True):
            assert torch.equal(got[0], orig[1]) and torch.equal(got[3], orig[2]), f"rank {rank}"
        worker.close()
    if kind == "disk":
        names = {p.name for p in (tmp_path / "shared" / "default").rglob("*.kvb")}
        assert len(names) == 2 * world_size
        assert f"{keys[0][:-4].hex()}-g0-r{world_size - 1}of{world_size}x1.kvb" in names


def test_a_shard_too_short_for_the_slot_is_a_failed_load(tmp_path):
    """A value of another geometry (e.g. another TP size wrote it under a colliding
    name) fails the load rather than filling part of the slot."""
    tier = DiskTier({"path": str(tmp_path / "shared"), "capacity_bytes": 1 << 20})
    key = _okeys(1)[0]
    shard = Shard(0, 2)
    path = tier._path(tier_key(key, shard))  # noqa: SLF001
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(frame_value(tier_key(key, shard), b"short"))
    assert path.stat().st_size == HEADER_BYTES + 5
    worker = WorkerTiers([tier], shard=shard)
    worker.bind_buffer(_planes(0))
    worker.start_reads(1, [TierRead(0, key, [0])])
    assert _poll(worker.finished_reads) == [(1, False)]
    worker.close()


def test_each_rank_budgets_and_evicts_only_its_own_files(tmp_path):
    """Ranks share a directory; a rank restarting indexes only its own shard's files, so
    its size budget never evicts another rank's shard (which would kill the chunk)."""

    def rank_tier(rank, capacity):
        return DiskTier({"path": str(tmp_path), "capacity_bytes": capacity}, shard=Shard(rank, 2))

    key = _okeys(1)[0]
    with rank_tier(0, 1 << 20) as zero:
        zero.store([(tier_key(key, Shard(0, 2)), b"0" * 100)])
        assert zero.flush(30)
    other = _okeys(2)[1]
    with rank_tier(1, 150) as one:  # room for one value of its own
        assert one.bytes_used == 0
        one.store([(tier_key(key, Shard(1, 2)), b"1" * 100)])
        one.store([(tier_key(other, Shard(1, 2)), b"1" * 100)])
        assert one.flush(30)
    names = {p.name for p in tmp_path.rglob("*.kvb")}
    assert f"{key[:-4].hex()}-g0-r0of2x1.kvb" in names  # rank 0's shard survived
    assert f"{key[:-4].hex()}-g0-r1of2x1.kvb" not in names  # rank 1 evicted its own, older one
    assert f"{other[:-4].hex()}-g0-r1of2x1.kvb" in names


# --------------------------------------------------------------------- end to end
def _tp_run(connector, world_size, trace, pipeline_parallel_size=1, before_run=None):
    engine, tp = tp_engine(
        EngineConfig(connector=connector, **ENGINE), world_size, pipeline_parallel_size
    )
    try:
        if before_run is not None:
            before_run(engine, tp)
        return engine.run(trace), tp.samples
    finally:
        tp.shutdown()
        engine.shutdown()


@pytest.fixture(scope="module")
def tp_baseline():
    """Per world size: rank 0's outputs and every rank's samples without a connector."""
    runs = {}

    def get(world_size):
        if world_size not in runs:
            runs[world_size] = _tp_run(None, world_size, doc_trace())
        return runs[world_size]

    return get


def _disk(path):
    return {"type": "disk", "path": str(path), "capacity_bytes": 1 << 26}


def _assert_same_as(base, got):
    (base_result, base_samples), (result, samples) = base, got
    assert result.outputs == base_result.outputs
    for rank, (want, have) in enumerate(zip(base_samples, samples, strict=True)):
        assert have == want, f"rank {rank} computed other tokens: it read KV that is not its own"


@pytest.mark.parametrize(("world_size", "pp"), [(2, 1), (4, 2)])
def test_tp_workers_are_served_their_own_shards_from_disk(tmp_path, tp_baseline, world_size, pp):
    got = _tp_run(offload(_disk(tmp_path)), world_size, doc_trace(), pp)
    _assert_same_as(tp_baseline(world_size), got)
    stats = got[0].metrics.connector_stats
    assert stats["disk_loads"] > 0 and stats.get("disk_load_failures", 0) == 0
    files = {p.name for p in tmp_path.rglob("*.kvb")}
    tp = world_size // pp
    assert {f.rsplit("-r", 1)[1] for f in files} == {
        f"{r}of{tp}x{pp}.kvb" for r in range(world_size)
    }


def test_tp_workers_behind_the_fault_injector_are_served_their_own_shards(tmp_path, tp_baseline):
    """Wrapped in the kit's FaultInjector, cpu_offload runs as the worker the engine built:
    each rank writes and reads its own disk shard (run as rank 0 of 1 everywhere, the
    ranks wrote and read each other's values)."""
    got = _tp_run(fault_injection_config(offload(_disk(tmp_path))), 2, doc_trace())
    _assert_same_as(tp_baseline(2), got)
    assert got[0].metrics.connector_stats["disk_loads"] > 0
    assert {p.name.rsplit("-r", 1)[1] for p in tmp_path.rglob("*.kvb")} == {
        "0of2x1.kvb", "1of2x1.kvb"
    }


def test_the_check_sees_a_rank_loading_another_ranks_shard(tmp_path, tp_baseline, monkeypatch):
    """The end-to-end check has teeth: with the shard left out of the keys (the old
    format), ranks overwrite each other's values and a rank's samples differ."""
    import connectors.offload.tiers.scheduler as scheduler_tiers
    import connectors.offload.tiers.worker as worker_tiers

    plain = scheduler_tiers.tier_key
    for module in (scheduler_tiers, worker_tiers):
        monkeypatch.setattr(module, "tier_key", lambda key, shard=None: plain(key))
    result, samples = _tp_run(offload(_disk(tmp_path)), 2, doc_trace())
    assert result.metrics.connector_stats["disk_loads"] > 0
    assert samples != tp_baseline(2)[1]


def _drop_shards_before_loading(rank):
    """Make rank ``rank``'s tier lose every value it is about to load, as if another
    engine's disk budget or Redis eviction took it between lookup and load."""

    def install(engine, tp):
        worker = (engine.worker_connector if rank == 0 else tp.connectors[rank - 1]).worker_side
        tier = worker.tiers.tiers[0]
        load_into = tier.load_into

        def vanishing(keys, dests):
            for key in keys:
                if isinstance(tier, DiskTier):
                    tier._path(key).unlink(missing_ok=True)  # noqa: SLF001
                else:
                    tier._conn().delete(tier.redis_key(key))  # noqa: SLF001
            return load_into(keys, dests)

        tier.load_into = vanishing

    return install


def test_a_shard_gone_before_its_load_is_recomputed_never_mixed(tmp_path, tp_baseline):
    got = _tp_run(
        offload(_disk(tmp_path)), 2, doc_trace(), before_run=_drop_shards_before_loading(1)
    )
    _assert_same_as(tp_baseline(2), got)
    stats = got[0].metrics.connector_stats
    assert stats["disk_load_failures"] > 0
    assert got[0].metrics.connector_errors == {}


def _redis(url, salt):
    return {"type": "redis", "url": url, "model": "tp-test", "tenant_salt": salt}


@pytest.mark.redis
def test_two_tp_engines_share_one_redis(redis_single, tp_baseline, request):
    """Engine A (TP=2) stores every prefix in Redis; engine B (TP=2, fresh CPU tier)
    is served A's shards, each rank its own."""
    salt = request.node.name
    a = _tp_run(offload(_redis(redis_single.url, salt)), 2, doc_trace(rounds=1))
    assert a[0].metrics.connector_stats["redis_stores"] > 0
    b = _tp_run(offload(_redis(redis_single.url, salt)), 2, doc_trace())
    _assert_same_as(tp_baseline(2), b)
    assert b[0].metrics.connector_stats["redis_loads"] > 0
    assert b[0].metrics.connector_hit_tokens > 0


@pytest.mark.redis
def test_a_redis_shard_evicted_before_its_load_is_recomputed(redis_single, tp_baseline, request):
    got = _tp_run(
        offload(_redis(redis_single.url, request.node.name)),
        2,
        doc_trace(),
        before_run=_drop_shards_before_loading(0),
    )
    _assert_same_as(tp_baseline(2), got)
    assert got[0].metrics.connector_stats["redis_load_failures"] > 0
